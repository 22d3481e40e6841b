"""Array stores in every format (spmd.data.formats.stores): NetCDF4 files written by h5netcdf, Zarr
v3
stores (sharded arrays included), with slab reads that touch only the slab's chunks, and
errors that name the file, the variable and the config key."""

from __future__ import annotations

import h5netcdf
import numpy as np
import pytest
import zarr
import zarr.storage

from spmd.data import ArrayDataError, ArraySource, BatchField, write_arrays
from spmd.data.formats import stores
from spmd.data.sources.arrays import store_format

N, BATCH, GRID = 12, 4, 8
FIELDS = {"u0": BatchField((GRID, GRID, 1), np.float32, ("batch", "x", "y", None)),
          "u1": BatchField((GRID, GRID, 2), np.float32, ("batch", "x", "y", "channels"))}


def arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    return {"train/u0": rng.standard_normal((N, GRID, GRID)).astype(np.float32),
            "train/u1": rng.standard_normal((N, GRID, GRID, 2)).astype(np.float64)}


def source(path, **kw) -> ArraySource:
    return ArraySource(path, {"u0": "train/u0", "u1": "train/u1"}, FIELDS, BATCH,
                       **{"seed": 1, **kw})


def check_rows(src: ArraySource) -> None:
    data = arrays()
    for step in (0, 2, 5):
        rows = src.rows(step, 0, BATCH)
        for i, record in enumerate(src.record_indices(step, 0, BATCH)):
            np.testing.assert_array_equal(rows["u0"][i, ..., 0], data["train/u0"][record])
            np.testing.assert_array_equal(rows["u1"][i], data["train/u1"][record]
                                          .astype(np.float32))


def test_netcdf4_written_by_h5netcdf_reads_correctly(tmp_path):
    """A NetCDF4 file as a standard writer makes it: named dimensions shared by the
    variables of a group, attributes, a coordinate variable, compression."""
    path, data = tmp_path / "sim.nc", arrays()
    with h5netcdf.File(path, "w") as f:
        f.attrs["title"] = "heat"
        train = f.create_group("train")
        train.dimensions = {"sample": N, "x": GRID, "y": GRID, "c": 2}
        x = train.create_variable("x", ("x",), "f8", data=np.linspace(0, 1, GRID))
        x.attrs["units"] = "m"
        train.create_variable("u0", ("sample", "x", "y"), "f4", data=data["train/u0"],
                              chunks=(1, GRID, GRID), compression="gzip")
        train.create_variable("u1", ("sample", "x", "y", "c"), "f8", data=data["train/u1"])
    assert store_format(path) == "netcdf"
    src = source(path)
    assert src.count == N and src.files.members[0].format == "netcdf"
    check_rows(src)
    region = {"u0": ((4, 8), (2, 6), (0, 1)), "u1": ((0, 4), (0, 8), (1, 2))}
    got = src.rows(3, 0, BATCH, region)
    records = src.record_indices(3, 0, BATCH)
    np.testing.assert_array_equal(got["u0"][..., 0], data["train/u0"][records, 4:8, 2:6])
    np.testing.assert_array_equal(got["u1"], data["train/u1"][records, 0:4, :, 1:2]
                                  .astype(np.float32))
    with pytest.raises(ArrayDataError) as e:
        ArraySource(path, {"u0": "train/u0", "u1": "train/v"}, FIELDS, BATCH).check()
    msg = str(e.value)
    assert f"data.path={path}" in msg and "NetCDF variable 'train/v'" in msg
    assert "data.fields.u1" in msg and "train/u1" in msg           # what the file has


def test_netcdf_written_by_write_arrays_and_netcdf3_read_as_it_lies(tmp_path):
    path = write_arrays(tmp_path / "w.nc", arrays(), {"seed": 3}, format="netcdf")
    check_rows(source(path))
    with h5netcdf.File(path, "r") as f:                 # a valid NetCDF4 file
        assert f.attrs["seed"] == 3 and f["train/u1"].dimensions == (
            "u1_0", "u1_1", "u1_2", "u1_3")
    import netCDF4

    data = arrays()                                    # NetCDF3 has no groups: root variables
    classic = tmp_path / "classic.nc"
    with netCDF4.Dataset(classic, "w", format="NETCDF3_CLASSIC") as f:
        for name, size in (("sample", None), ("x", GRID), ("y", GRID), ("c", 2)):
            f.createDimension(name, size)              # records: the unlimited dimension
        f.createVariable("u0", "f4", ("sample", "x", "y"))[:] = data["train/u0"]
        f.createVariable("u1", "f8", ("sample", "x", "y", "c"))[:] = data["train/u1"]
    assert store_format(classic) == "netcdf3"
    src = ArraySource(classic, {"u0": "u0", "u1": "u1"}, FIELDS, BATCH, seed=1)
    assert src.count == N
    check_rows(src)
    with pytest.raises(ArrayDataError) as e:
        ArraySource(classic, {"u0": "u0", "u1": "v"}, FIELDS, BATCH).check()
    assert "NetCDF variable 'v'" in str(e.value) and "data.fields.u1" in str(e.value)
    cut = tmp_path / "cut.nc"                          # truncated: refused, named
    cut.write_bytes(classic.read_bytes()[:-GRID * GRID * 8])
    with pytest.raises(ArrayDataError, match=r"cut.nc: cannot open the NetCDF3 .*truncated"):
        ArraySource(cut, {"u0": "u0", "u1": "u1"}, FIELDS, BATCH).check()
    neither = tmp_path / "neither.nc"
    neither.write_bytes(b"not a netcdf file at all" * 4)
    with pytest.raises(ArrayDataError, match=r"neither.nc: not a NetCDF4 file \(nor NetCDF3\)"):
        source(neither).check()


@pytest.mark.parametrize("shards", [None, (4, GRID, GRID)])
def test_zarr_stores_read_correctly(tmp_path, shards):
    chunks = {"train/u0": (1, 4, 4), "train/u1": (1, 4, 4, 2)}
    path = write_arrays(tmp_path / "sim.zarr", arrays(), {"seed": 3}, format="zarr",
                        chunks=chunks, shards={"train/u0": shards} if shards else None)
    assert store_format(path) == "zarr"
    assert zarr.open_array(path / "train/u0", mode="r").shards == shards
    check_rows(source(path))
    with pytest.raises(ArrayDataError) as e:
        ArraySource(path, {"u0": "train/nope", "u1": "train/u1"}, FIELDS, BATCH).check()
    msg = str(e.value)
    assert f"data.path={path}" in msg and "Zarr array 'train/nope'" in msg
    assert "data.fields.u0" in msg


class CountingStore(zarr.storage.LocalStore):
    """A local Zarr store that records the chunk keys read (whole or in byte ranges)."""

    keys: list[tuple[str, str]] = []     # (chunk key, kind of byte range or "whole")

    async def get(self, key, prototype, byte_range=None):
        if "/c/" in key:
            CountingStore.keys.append((key, type(byte_range).__name__ if byte_range
                                       else "whole"))
        return await super().get(key, prototype, byte_range)


@pytest.mark.parametrize("sharded", [False, True])
def test_zarr_slab_reads_touch_only_the_slab_chunks(tmp_path, monkeypatch, sharded):
    """x split in 2, y in 2 (chunks of 4 x 4): the slab (4:8, 0:4) reads one chunk per
    record, never the other three; values equal the whole example's slab."""
    data = {"train/u0": arrays()["train/u0"]}
    path = write_arrays(tmp_path / "f.zarr", data, format="zarr",
                        chunks={"train/u0": (1, 4, 4)},
                        shards={"train/u0": (2, GRID, GRID)} if sharded else None)
    fields = {"u0": FIELDS["u0"]}
    monkeypatch.setattr(stores, "open_zarr", lambda p, where: zarr.open_group(
        CountingStore(str(p), read_only=True), mode="r"))
    src = ArraySource(path, {"u0": "train/u0"}, fields, BATCH, seed=2)
    CountingStore.keys = []
    got = src.rows(1, 0, BATCH, {"u0": ((4, 8), (0, 4), (0, 1))})
    records = src.record_indices(1, 0, BATCH)
    np.testing.assert_array_equal(got["u0"][..., 0], data["train/u0"][records, 4:8, 0:4])
    assert src.bytes_read == BATCH * 4 * 4 * 4
    if sharded:     # per record: its shard's index, then one inner chunk by byte range
        ranges = [k for k, kind in CountingStore.keys if kind == "RangeByteRequest"]
        assert sorted(ranges) == sorted(f"train/u0/c/{r // 2}/0/0" for r in records)
        assert all(kind != "whole" for _, kind in CountingStore.keys)
    else:           # one chunk of four per record
        assert sorted(CountingStore.keys) == sorted((f"train/u0/c/{r}/1/0", "whole")
                                                    for r in records)
    assert stores.OPENED[str(path)] >= 1


def test_single_store_errors_and_npy_still_work(tmp_path):
    npy = write_arrays(tmp_path / "d", arrays(), format="npy")
    assert store_format(npy) == "npy"
    check_rows(source(npy))
    bad = tmp_path / "bad.h5"
    bad.write_bytes(b"not hdf5")
    with pytest.raises(ArrayDataError, match=r"bad.h5: not an HDF5 file"):
        source(bad).check()
    broken = tmp_path / "broken.zarr"
    broken.mkdir()
    (broken / "zarr.json").write_text("{")
    with pytest.raises(ArrayDataError, match=r"broken.zarr: cannot open the Zarr store"):
        source(broken).check()
