"""spmd.data.formats.zarr_chunks: records of Zarr v3 arrays of one record per chunk read from their
chunk files equal what zarr reads; other layouts go through zarr; a damaged chunk file
is named."""

from __future__ import annotations

import re

import numpy as np
import pytest
import zarr
from zarr.codecs import BloscCodec, BytesCodec, Crc32cCodec, GzipCodec, ZstdCodec

from spmd.data import ArrayDataError, ArraySource, BatchField, write_arrays
from spmd.data.formats.stores import Store
from spmd.data.formats.zarr_chunks import ChunkRecords

ROWS, SHAPE = 13, (6, 4)
FIELD = {"u": BatchField((*SHAPE, 1), np.float32, ("batch", "x", "y", None))}


def values(dtype=np.float32) -> np.ndarray:
    return np.random.default_rng(5).standard_normal((ROWS, *SHAPE)).astype(dtype)


def write_zarr(path, data, **kw):
    root = zarr.open_group(str(path), mode="w")
    kw.setdefault("chunks", (1, *data.shape[1:]))
    array = root.create_array("train/u", shape=data.shape, dtype=data.dtype, **kw)
    array[...] = data
    return path


def read_all(path) -> np.ndarray | None:
    """Every record through the chunk reader (None: no reader)."""
    store = Store(path, "test")
    try:
        reader = store.direct("train/u", "data.fields.u")
        if reader is None:
            return None
        assert isinstance(reader, ChunkRecords)
        out = np.empty((ROWS, *SHAPE), reader.dtype)
        assert reader.read(list(range(ROWS)), list(out))[0] == []
        return out
    finally:
        store.close()


@pytest.mark.parametrize("compressors", ["default", None, GzipCodec(level=3),
                                         BloscCodec(cname="lz4", clevel=5)],
                         ids=["zstd", "none", "gzip", "blosc"])
def test_one_record_per_chunk_reads_what_zarr_reads(tmp_path, compressors):
    data = values()
    kw = {} if compressors == "default" else {"compressors": compressors}
    path = write_zarr(tmp_path / "d.zarr", data, **kw)
    np.testing.assert_array_equal(read_all(path), data)


def test_integer_records_read_directly(tmp_path):
    data = (values() * 1000).astype(np.int32)
    path = write_zarr(tmp_path / "d.zarr", data, compressors=ZstdCodec(level=1))
    store = Store(path, "t")
    reader = store.direct("train/u", "k")
    out = np.empty_like(data)
    assert reader.read(list(range(ROWS)), list(out))[0] == []
    store.close()
    np.testing.assert_array_equal(out, data)


@pytest.mark.parametrize("kw", [{"chunks": (2, *SHAPE)},
                                {"chunks": (1, 3, 4)},
                                {"chunks": (1, *SHAPE), "shards": (ROWS, *SHAPE)},
                                {"serializer": BytesCodec(endian="big")},
                                {"compressors": [Crc32cCodec()]}],
                         ids=["two-per-chunk", "split-record", "sharded", "big-endian", "crc"])
def test_other_layouts_are_read_through_zarr(tmp_path, kw):
    data = values()
    path = write_zarr(tmp_path / "d.zarr", data, **kw)
    assert read_all(path) is None
    src = ArraySource(path, {"u": "train/u"}, FIELD, ROWS, shuffle=False)
    np.testing.assert_array_equal(src.rows(0, 0, ROWS)["u"][..., 0], data)


def test_chunks_never_written_read_the_fill_value(tmp_path):
    """zarr writes no chunk file for a record equal to the fill value: read through zarr."""
    data = values()
    data[[0, 5]] = 0.0
    path = write_arrays(tmp_path / "d.zarr", {"train/u": data}, format="zarr")
    store = Store(path, "t")
    reader = store.direct("train/u", "k")
    out = np.full((ROWS, *SHAPE), np.nan, np.float32)
    assert reader.read(list(range(ROWS)), list(out))[0] == [0, 5]
    store.close()
    src = ArraySource(path, {"u": "train/u"}, FIELD, ROWS, shuffle=False)
    np.testing.assert_array_equal(src.rows(0, 0, ROWS)["u"][..., 0], data)


def test_the_source_reads_directly_and_equals_zarr(tmp_path, monkeypatch):
    """Shuffled steps over two stores: the same bytes with chunk reads as through zarr, and
    the chunk reader did the reading."""
    data = values()
    for i, part in enumerate((data[:6], data[6:])):
        write_arrays(tmp_path / f"p{i}.zarr", {"train/u": part}, format="zarr")
    calls: list[int] = []
    real = ChunkRecords.read

    def count(self, rows, buffers):
        calls.append(len(rows))
        return real(self, rows, buffers)

    monkeypatch.setattr(ChunkRecords, "read", count)
    src = ArraySource(tmp_path / "*.zarr", {"u": "train/u"}, FIELD, 5, seed=3)
    got = [src.rows(step, 0, 5)["u"] for step in range(5)]
    assert sum(calls) >= 25
    monkeypatch.setattr(Store, "direct", lambda self, dataset, key: None)
    plain = ArraySource(tmp_path / "*.zarr", {"u": "train/u"}, FIELD, 5, seed=3)
    for step in range(5):
        assert got[step].tobytes() == plain.rows(step, 0, 5)["u"].tobytes()
        np.testing.assert_array_equal(got[step][..., 0], data[src.record_indices(step, 0, 5)])


def test_a_slab_reads_through_zarr(tmp_path, monkeypatch):
    data = values()
    path = write_arrays(tmp_path / "d.zarr", {"train/u": data}, format="zarr")
    monkeypatch.setattr(ChunkRecords, "read", lambda *a: pytest.fail("read the whole record"))
    src = ArraySource(path, {"u": "train/u"}, FIELD, 4, shuffle=False)
    slab = src.rows(0, 0, 4, region={"u": ((2, 5), (0, 4), (0, 1))})["u"]
    np.testing.assert_array_equal(slab[..., 0], data[:4, 2:5])


def test_a_damaged_chunk_file_is_named(tmp_path):
    data = values()
    path = write_arrays(tmp_path / "d.zarr", {"train/u": data}, format="zarr")
    src = ArraySource(path, {"u": "train/u"}, FIELD, ROWS, shuffle=False)
    src.rows(0, 0, 2)                                   # the reader is found now
    chunk = path / "train" / "u" / "c" / "7" / "0" / "0"
    chunk.write_bytes(chunk.read_bytes()[:10])
    with pytest.raises(ArrayDataError, match=r"d\.zarr.*'train/u'.*c/7/0/0.*damaged"):
        src.rows(0, 0, ROWS)


def test_the_source_says_it_reads_chunk_files_of_a_store_zarr_and_xarray_wrote(tmp_path):
    """`reads()` (what `spmd data info` prints) names the direct chunk reader for a store
    written by zarr itself and one written by xarray (as WeatherBench2 writes its stores),
    with this zarr release: a release that moves zarr's classes must not turn it off."""
    import xarray as xr

    data = values()
    by_zarr = write_zarr(tmp_path / "z.zarr", data, compressors=ZstdCodec(level=3))
    src = ArraySource(by_zarr, {"u": "train/u"}, FIELD, ROWS, shuffle=False)
    assert src.reads() == {"u": "train/u: direct chunk reads: one record per chunk file, "
                                "bytes+zstd"}
    by_xarray = tmp_path / "x.zarr"
    xr.Dataset({"u": (("time", "lat", "lon"), data)}).to_zarr(
        by_xarray, zarr_format=3, encoding={"u": {"chunks": (1, *SHAPE)}})
    src = ArraySource(by_xarray, {"u": "u"}, FIELD, ROWS, shuffle=False)
    assert src.reads()["u"].startswith("u: direct chunk reads: one record per chunk file")
    np.testing.assert_array_equal(src.rows(0, 0, ROWS)["u"][..., 0], data)


@pytest.mark.parametrize("kw, why", [
    ({"chunks": (2, *SHAPE)}, r"chunks \(2, 6, 4\), not one record \(1, 6, 4\) each"),
    ({"chunks": (1, *SHAPE), "shards": (ROWS, *SHAPE)}, r"codec ShardingCodec before"),
    ({"compressors": [Crc32cCodec()]}, r"codec Crc32cCodec \(chunk files are read directly"),
], ids=["two-per-chunk", "sharded", "crc"])
def test_the_source_says_why_it_reads_through_zarr(tmp_path, kw, why):
    path = write_zarr(tmp_path / "d.zarr", values(), **kw)
    src = ArraySource(path, {"u": "train/u"}, FIELD, ROWS, shuffle=False)
    assert re.fullmatch(r"train/u: through zarr: " + why + ".*", src.reads()["u"])


def test_readers_are_refused_for_other_arrays():
    reader, why = ChunkRecords.find(np.zeros((3, 2)))
    assert reader is None and why.startswith("zarr ")


def test_spmd_data_info_names_the_direct_reader_of_a_zarr_store(tmp_path):
    """The CLI, as a user runs it, on a Zarr v3 store that zarr itself wrote with one record
    per chunk: `spmd data info` says each field is read straight from its chunk files."""
    from tests.helpers.env import REPO, run_spmd

    rng = np.random.default_rng(2)
    root = zarr.open_group(str(tmp_path / "fields.zarr"), mode="w")
    for split, n in (("train", 8), ("test", 4)):
        for name in ("f", "u"):
            array = root.create_array(f"{split}/{name}", shape=(n, 8, 8, 1), dtype="float32",
                                      chunks=(1, 8, 8, 1))
            array[...] = rng.standard_normal((n, 8, 8, 1)).astype(np.float32)
    info = run_spmd("data", "info", "examples/vit2d/config.yaml", "model.grid=8",
                    "data.source=zarr", f"data.path={tmp_path / 'fields.zarr'}",
                    "data.num_train=8", "data.num_test=4", cwd=REPO, timeout=120)
    assert info.returncode == 0, info.stderr[-3000:]
    for name in ("f", "u"):
        assert (f"reads {name} (train/{name}: direct chunk reads: one record per chunk file, "
                f"bytes+zstd)") in info.stdout, info.stdout
