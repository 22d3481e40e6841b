"""spmd.data.formats.direct_reads: whole records of uncompressed HDF5 / NetCDF4 datasets read from
the file's bytes equal what h5py reads; anything else goes through h5py; a truncated file
is named."""

from __future__ import annotations

import os
import threading

import h5py
import numpy as np
import pytest

import spmd.data.formats.direct_reads as direct_reads
from spmd.data import ArrayDataError, ArraySource, BatchField, write_arrays
from spmd.data.formats.direct_reads import DirectLayout, read_jobs
from spmd.data.formats.stores import Store

ROWS, SHAPE = 23, (6, 4)
FIELD = {"u": BatchField((*SHAPE, 1), np.float32, ("batch", "x", "y", None))}


def values(dtype=np.float32) -> np.ndarray:
    return np.random.default_rng(3).standard_normal((ROWS, *SHAPE)).astype(dtype)


def write_h5(path, data, **kw) -> str:
    with h5py.File(path, "w", **kw.pop("file", {})) as f:
        f.create_dataset("train/u", data=data, **kw)
    return str(path)


def direct_values(path, dataset="train/u") -> np.ndarray | None:
    """Every record read through the layout (None: no layout)."""
    store = Store(path, "test")
    try:
        reader = store.direct(dataset, "data.fields.u")
        if reader is None:
            return None
        array = store.get(dataset, "k")
        out = np.empty(array.shape, reader.layout.dtype)
        jobs = [(reader.fd, out[r], reader.layout.offset(r)) for r in range(array.shape[0])]
        read_jobs(jobs, reader.layout.row_bytes)
        assert [reader.layout.by_row[r] for r in range(array.shape[0])] == \
            [job[2] for job in jobs]                       # the table a read looks up
        return out
    finally:
        store.close()


@pytest.mark.parametrize("limit", ["rows", "budget"])
def test_a_dataset_past_the_offset_tables_limits_is_read_through_offset(tmp_path,
                                                                      monkeypatch, limit):
    """Past TABLE_ROWS rows, or past TABLE_BUDGET bytes of tables in the process, offsets
    are computed per record: the same records."""
    if limit == "rows":
        monkeypatch.setattr(direct_reads, "TABLE_ROWS", 4)
    else:
        monkeypatch.setattr(direct_reads, "TABLE_BUDGET", direct_reads._tables["bytes"] + 8)
    data = values()
    for chunks in (None, (5, *SHAPE)):
        path = write_h5(tmp_path / f"d{chunks is None}.h5", data, chunks=chunks)
        np.testing.assert_array_equal(direct_values(path), data)
        store = Store(path, "test")
        try:
            assert isinstance(store.direct("train/u", "k").layout.by_row, direct_reads._ByRow)
        finally:
            store.close()


@pytest.mark.parametrize("chunks", [None, (1, *SHAPE), (5, *SHAPE), True])
def test_uncompressed_layouts_read_what_h5py_reads(tmp_path, chunks):
    """Contiguous, one record per chunk, five per chunk (the last chunk partial), and h5py's
    automatic chunks (which split records: refused)."""
    data = values()
    path = write_h5(tmp_path / "d.h5", data, chunks=chunks)
    got = direct_values(path)
    if chunks is True and h5py.File(path)["train/u"].chunks[1:] != SHAPE:
        assert got is None
    else:
        assert got is not None
        np.testing.assert_array_equal(got, data)


def test_netcdf_variables_read_directly(tmp_path):
    data = values()
    path = write_arrays(tmp_path / "d.nc", {"train/u": data}, format="netcdf")
    got = direct_values(path)
    assert got is not None
    np.testing.assert_array_equal(got, data)


@pytest.mark.parametrize("kw", [{"compression": "gzip", "chunks": (1, *SHAPE)},
                                {"shuffle": True, "chunks": (1, *SHAPE)},
                                {"fletcher32": True, "chunks": (1, *SHAPE)},
                                {"chunks": (1, 3, 4)},
                                {"dtype": ">f4"}])
def test_other_storage_is_read_through_h5py(tmp_path, kw):
    path = write_h5(tmp_path / "d.h5", values(), **kw)
    assert direct_values(path) is None


def test_a_userblock_file_reads_the_right_bytes(tmp_path):
    """HDF5 addresses are relative to the file's base (after a user block): a layout, when
    there is one, must read the right values (it checks itself against h5py)."""
    data = values()
    path = write_h5(tmp_path / "d.h5", data, chunks=(1, *SHAPE), file={"userblock_size": 512})
    got = direct_values(path)
    assert got is None or np.array_equal(got, data)
    src = ArraySource(path, {"u": "train/u"}, FIELD, ROWS, shuffle=False)
    np.testing.assert_array_equal(src.rows(0, 0, ROWS)["u"][..., 0], data)


def test_chunks_never_written_read_the_fill_value(tmp_path):
    path = tmp_path / "d.h5"
    with h5py.File(path, "w") as f:
        d = f.create_dataset("train/u", shape=(ROWS, *SHAPE), dtype=np.float32,
                             chunks=(1, *SHAPE), fillvalue=7.0)
        for r in (0, 4, ROWS - 1):
            d[r] = r
    with h5py.File(path) as f:
        want = f["train/u"][...]
    store = Store(path, "test")
    layout = store.direct("train/u", "k").layout
    store.close()
    assert (layout.offsets(np.arange(ROWS)) >= 0).sum() == 3
    src = ArraySource(path, {"u": "train/u"}, FIELD, ROWS, shuffle=False)
    got = src.rows(0, 0, ROWS)["u"][..., 0]
    np.testing.assert_array_equal(got, want)
    assert got[1, 0, 0] == 7.0 and got[4, 0, 0] == 4.0


def counting(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = direct_reads.read_jobs

    def count(jobs, row_bytes):
        calls.append(len(jobs))
        return real(jobs, row_bytes)

    monkeypatch.setattr(direct_reads, "read_jobs", count)
    return calls


@pytest.mark.parametrize("compression", [None, "gzip"])
def test_the_source_reads_directly_and_equals_h5py(tmp_path, monkeypatch, compression):
    """Shuffled steps over two files: the same batches with direct reads as through h5py
    (direct reads off); direct reads happen only for the uncompressed files."""
    data = values()
    for i, part in enumerate((data[:11], data[11:])):
        write_h5(tmp_path / f"p{i}.h5", part, chunks=(1, *SHAPE), compression=compression)
    calls = counting(monkeypatch)
    src = ArraySource(tmp_path / "*.h5", {"u": "train/u"}, FIELD, 8, seed=2)
    got = [src.rows(step, 0, 8)["u"] for step in range(6)]
    assert (sum(calls) > 0) == (compression is None)
    monkeypatch.setattr(Store, "direct", lambda self, dataset, key: None)
    plain = ArraySource(tmp_path / "*.h5", {"u": "train/u"}, FIELD, 8, seed=2)
    for step in range(6):
        assert got[step].tobytes() == plain.rows(step, 0, 8)["u"].tobytes()
        records = src.record_indices(step, 0, 8)
        np.testing.assert_array_equal(got[step][..., 0], data[records])


def test_a_cast_or_a_slab_reads_through_h5py(tmp_path, monkeypatch):
    data = values()
    path = write_h5(tmp_path / "d.h5", data, chunks=(1, *SHAPE))
    calls = counting(monkeypatch)
    wide = {"u": BatchField((*SHAPE, 1), np.float64, ("batch", "x", "y", None))}
    src = ArraySource(path, {"u": "train/u"}, wide, 4, shuffle=False)
    np.testing.assert_array_equal(src.rows(0, 0, 4)["u"][..., 0], data[:4].astype(np.float64))
    src = ArraySource(path, {"u": "train/u"}, FIELD, 4, shuffle=False)
    slab = src.rows(0, 0, 4, region={"u": ((2, 5), (0, 4), (0, 1))})["u"]
    np.testing.assert_array_equal(slab[..., 0], data[:4, 2:5])
    assert calls == []


@pytest.mark.parametrize("nowait", [True, False])
def test_cold_pages_and_no_rwf_nowait_read_the_same(tmp_path, monkeypatch, nowait):
    data = values()
    path = write_h5(tmp_path / "d.h5", data, chunks=(1, *SHAPE))
    if not nowait:
        monkeypatch.setattr(direct_reads, "_NOWAIT", None)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    np.testing.assert_array_equal(direct_values(path), data)


def test_a_file_truncated_under_a_run_is_named(tmp_path):
    data = values()
    path = write_h5(tmp_path / "d.h5", data, chunks=(1, *SHAPE))
    src = ArraySource(path, {"u": "train/u"}, FIELD, ROWS, shuffle=False)
    src.rows(0, 0, 2)                                  # the layout is found now
    with h5py.File(path) as f:
        last = f["train/u"].id.get_chunk_info(ROWS - 1).byte_offset
    os.truncate(path, last + 8)
    with pytest.raises(ArrayDataError, match=r"d\.h5.*'train/u'.*truncated"):
        src.rows(0, 0, ROWS)


def test_layouts_are_refused_without_h5py_datasets():
    assert DirectLayout.of(np.zeros((3, 2)), -1) is None


def test_a_cold_read_announces_the_next_steps_and_a_warm_one_nothing(tmp_path, monkeypatch):
    """Records that missed the page cache (here: a file system that cannot say, so every
    record counts as a miss) make the source announce rows [start, stop) of the next
    READAHEAD_STEPS steps, once each; reads that hit the cache announce nothing (a full
    shuffle: blocks are told a group ahead, the test below)."""
    from spmd.data.formats.direct_reads import FileRecords

    path = write_h5(tmp_path / "d.h5", values(), chunks=(1, *SHAPE))
    told: list[list[int]] = []
    real = FileRecords.advise
    monkeypatch.setattr(FileRecords, "advise",
                        lambda self, rows: (told.append(rows), real(self, rows))[1])
    monkeypatch.setattr(direct_reads, "_NOWAIT", None)
    src = ArraySource(path, {"u": "train/u"}, FIELD, 4, seed=1, shuffle_block="full")
    src.rows(0, 1, 3)
    src.wait_announced()                           # told in the source's readahead thread
    ahead = src.READAHEAD_STEPS
    want = [r for t in range(1, 1 + ahead) for r in src.record_indices(t, 1, 3)]
    assert [r for rows in told for r in rows] == want
    src.rows(1, 1, 3)                              # one step further: one more step told
    src.wait_announced()
    assert told[-1] == src.record_indices(1 + ahead, 1, 3)
    src.rows(0, 1, 3)                              # nothing new to tell
    src.wait_announced()
    assert len(told) == 2
    monkeypatch.setattr(direct_reads, "_NOWAIT", getattr(os, "RWF_NOWAIT", None))
    if direct_reads._NOWAIT is not None:           # Linux: the page cache holds the file
        warm = ArraySource(path, {"u": "train/u"}, FIELD, 4, seed=1, shuffle_block="full")
        for step in range(3):
            warm.rows(step, 0, 4)
        warm.wait_announced()
        assert len(told) == 2


def test_a_few_misses_in_a_warm_read_start_no_readahead(tmp_path, monkeypatch):
    """A warm file still misses RWF_NOWAIT now and then (a page marked for the kernel's own
    readahead): a call counts as cold only when a quarter of its records or more missed."""
    from spmd.data.formats.direct_reads import FileRecords

    path = write_h5(tmp_path / "d.h5", values(), chunks=(1, *SHAPE))
    told: list[list[int]] = []
    where: set[str] = set()
    monkeypatch.setattr(FileRecords, "advise", lambda self, rows: (
        told.append(rows), where.add(threading.current_thread().name)))
    src = ArraySource(path, {"u": "train/u"}, FIELD, 8, seed=1, shuffle_block="full")
    src.rows(0, 0, 8)
    src._read_ahead(0, 0, 8, missed=1)             # 1 of 8: warm
    src.wait_announced()
    assert told == []
    src._read_ahead(0, 0, 8, missed=2)             # 2 of 8: cold, the next steps are told
    src.wait_announced()
    assert [name.split("_")[0] for name in where] == ["spmd-readahead"]  # off the read path
    assert told and [r for rows in told for r in rows] == [
        r for t in range(1, 1 + src.READAHEAD_STEPS) for r in src.record_indices(t, 0, 8)]


def test_a_layout_is_found_once_per_file_version(tmp_path, monkeypatch):
    """A store opened again (a member closed to stay under max_open, a new source) reuses
    the layout it found; a file rewritten since is looked at again and read right."""
    found: list[str] = []
    real = DirectLayout._find.__func__
    monkeypatch.setattr(DirectLayout, "_find",
                        classmethod(lambda cls, ds: (found.append(ds.name), real(cls, ds))[1]))
    data = values()
    path = write_h5(tmp_path / "d.h5", data, chunks=(1, *SHAPE))
    np.testing.assert_array_equal(direct_values(path), data)
    np.testing.assert_array_equal(direct_values(path), data)
    assert found == ["/train/u"]
    os.remove(path)
    again = values()[::-1].copy()
    write_h5(tmp_path / "d.h5", again, chunks=(1, *SHAPE))
    st = os.stat(path)                   # as a rewrite a moment later (mtime ticks ~4 ms)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    np.testing.assert_array_equal(direct_values(path), again)
    assert found == ["/train/u", "/train/u"]


def test_a_failing_read_names_its_job(tmp_path):
    path = write_h5(tmp_path / "d.h5", values(), chunks=(1, *SHAPE))
    fd = os.open(path, os.O_RDONLY)
    closed = os.open(path, os.O_RDONLY)
    os.close(closed)
    buffers = np.empty((2, 4), np.float32)
    try:
        with pytest.raises(direct_reads.ShortRead, match="offset 0 failed") as e:
            read_jobs([(fd, buffers[0], 0), (closed, buffers[1], 0)], 16)
        assert e.value.job == 1
    finally:
        os.close(fd)


def test_neighbouring_records_are_announced_as_one_range(tmp_path, monkeypatch):
    from spmd.data.formats.direct_reads import FileRecords

    data = values()
    path = write_h5(tmp_path / "d.h5", data, chunks=(1, *SHAPE))
    store = Store(path, "test")
    try:
        reader = store.direct("train/u", "data.fields.u")
        assert isinstance(reader, FileRecords)
        told: list[tuple[int, int]] = []
        monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, advice: told.append((off, n)))
        size, offset = reader.layout.row_bytes, reader.layout.offset
        assert all(offset(r + 1) == offset(r) + size for r in range(ROWS - 1))  # contiguous
        monkeypatch.setattr(direct_reads, "ADVISE_GAP", 0)    # only touching records merge
        reader.advise([9, 3, 4, 5, 6, 20])
        assert sorted(told) == [(offset(3), 4 * size), (offset(9), size), (offset(20), size)]
        told.clear()
        monkeypatch.setattr(direct_reads, "ADVISE_GAP", 11 * size)  # gaps of <= 11 bridged
        reader.advise([9, 3, 4, 5, 6, 20])
        assert told == [(offset(3), 18 * size)]
    finally:
        store.close()


@pytest.mark.parametrize("mix", [1, 2])
def test_with_shuffle_block_a_cold_read_announces_whole_blocks(tmp_path, monkeypatch, mix):
    """data.shuffle_block: the readahead tells the kernel every record of the group of
    data.shuffle_mix blocks being read and of the next group (each once, the step being
    read aside, a group at a time), so that they are fetched as long reads; an epoch still
    reads every record once."""
    from spmd.data.formats.direct_reads import FileRecords

    data = values()
    path = write_h5(tmp_path / "d.h5", data, chunks=(1, *SHAPE))
    told: list[int] = []
    calls: list[list[int]] = []
    real = FileRecords.advise
    monkeypatch.setattr(FileRecords, "advise", lambda self, rows: (
        told.extend(rows), calls.append(list(rows)), real(self, rows))[2])
    monkeypatch.setattr(direct_reads, "_NOWAIT", None)        # every read counts as cold
    src = ArraySource(path, {"u": "train/u"}, FIELD, 4, seed=1, shuffle_block=8,
                      shuffle_mix=mix)
    src.READAHEAD_STEPS = 1
    first = src.rows(0, 0, 4)["u"][..., 0]
    src.wait_announced()
    blocks, starts = src.index.visits(0)
    last = (int(starts[min(2, len(starts) - 1)]) - 1) // 4   # the step of group 1's end
    # steps 1..last (step 0 is read now: the read itself announces it), each record once
    assert sorted(told) == sorted(src.index.records(np.arange(4, 4 * (last + 1))).tolist())
    ahead = {r for b in blocks[:2 * mix].tolist() for r in range(8 * b, min(8 * b + 8, ROWS))}
    assert ahead - set(src.record_indices(0, 0, 4)) <= set(told)   # both groups, whole
    # told a group at a time, the one being read first: its records are not queued behind
    # the next group's
    this_group = src.index.records(np.arange(4, 4 * ((int(starts[1]) - 1) // 4 + 1)))
    assert sorted(calls[0]) == sorted(this_group.tolist())
    np.testing.assert_array_equal(first, data[src.record_indices(0, 0, 4)])
    seen = [r for step in range(-(-ROWS // 4)) for r in src.record_indices(step, 0, 4)]
    assert sorted(seen[:ROWS]) == list(range(ROWS))


def test_a_bad_shuffle_block_names_the_key(tmp_path):
    path = write_h5(tmp_path / "d.h5", values(), chunks=(1, *SHAPE))
    with pytest.raises(ArrayDataError, match="data.shuffle_block=0"):
        ArraySource(path, {"u": "train/u"}, FIELD, 4, shuffle_block=0)
    with pytest.raises(ArrayDataError, match="data.shuffle_block=some: .* auto .* full"):
        ArraySource(path, {"u": "train/u"}, FIELD, 4, shuffle_block="some")
    with pytest.raises(ArrayDataError, match="data.shuffle_mix=0"):
        ArraySource(path, {"u": "train/u"}, FIELD, 4, shuffle_mix=0)


def test_batch_buffers_are_64_byte_aligned(tmp_path):
    """XLA's CPU client takes 64-byte aligned host arrays without a copy."""
    from spmd.data.buffer_pool import BufferPool

    for shape, dtype in (((3, 5, 7), np.float32), ((1,), np.int8), ((0, 4), np.float64)):
        a = BufferPool().empty(shape, dtype)
        assert a.shape == shape and a.dtype == dtype
        assert a.size == 0 or a.ctypes.data % 64 == 0
        assert a.flags.c_contiguous and a.flags.writeable
    path = write_h5(tmp_path / "d.h5", values(), chunks=(1, *SHAPE))
    src = ArraySource(path, {"u": "train/u"}, FIELD, 4, seed=1)
    for step in range(3):
        assert src.rows(step, 0, 4)["u"].ctypes.data % 64 == 0
