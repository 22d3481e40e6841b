"""HDF5 records read straight from the file's bytes: one `pread` per record, no h5py call.

Why: h5py costs 12-20 µs per call whatever it reads, more than a 16 KiB record takes to
copy from the page cache, and it holds a global lock, so read threads cannot overlap it.
An uncompressed HDF5 dataset keeps each record's bytes at a fixed place in the file: the
contiguous layout at `base + row x row_bytes`, the chunked layout (chunks that hold whole
records) at its chunk's address plus the row's place in the chunk. `DirectLayout.of`
finds those places once per file and dataset in a process (remembered by inode, size and
modification time), from h5py's own chunk query, and `read_jobs` reads records with
`os.preadv` straight into the caller's batch buffer. `pread` releases the GIL, so read
threads do overlap. Records the page cache holds are copied first (`RWF_NOWAIT`); the
kernel is then told every byte range still missing (`posix_fadvise(WILLNEED)`), so that
a cold batch's records are fetched concurrently, not one after the other.

Invariants:
- Used only where the bytes on disk are the values: the default file driver, no filter
  (compression, shuffle, checksum), neither external, virtual nor compact storage, a
  fixed-size integer or float dtype in native byte order, every chunk holding whole
  records. `DirectLayout.of` returns None for anything else, and after building a layout
  checks it: the first and last allocated records read both ways must be equal, else None.
  The caller reads through h5py wherever there is no layout: the values are the same.
- A record in a chunk never written (HDF5 gives the fill value) has no offset (-1): the
  caller reads it through h5py.
- A short read (a truncated file) raises OSError naming the path and offset.
"""

from __future__ import annotations

import array
import collections
import errno
import functools
import os
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import h5py
import numpy as np

__all__ = ["DirectLayout", "FileRecords", "ShortRead", "read_cached", "read_jobs"]

NO_OFFSET = -1
# Layouts found in this process, by (device, inode, size, mtime, dataset): a member that
# ArraySource closed (it keeps at most `max_open` open) and opens again, or a source built
# again, does not walk its chunk index again (about 1.3 µs per chunk) nor check it again.
KNOWN_LAYOUTS = 4096
_KNOWN: collections.OrderedDict[tuple, DirectLayout | None] = collections.OrderedDict()
_KNOWN_LOCK = threading.Lock()
WILLNEED = getattr(os, "POSIX_FADV_WILLNEED", None)
ADVISE_GAP = 64 << 10       # records nearer than this are announced as one range
_NOWAIT = getattr(os, "RWF_NOWAIT", None)     # Linux: read only what the page cache holds


# DirectLayout.by_row: offset tables of up to TABLE_ROWS rows (8 MiB), all of them together
# in a process at most TABLE_BUDGET bytes; past either, offsets are computed per record.
TABLE_ROWS = 1 << 20
TABLE_BUDGET = 256 << 20
_tables = {"bytes": 0}


class ShortRead(OSError):
    """A record that cannot be read: its bytes end before its metadata says, do not decode
    to a record, or the read fails (`job`: its place in the list read)."""

    def __init__(self, job: int, message: str):
        super().__init__(message)
        self.job = job


@dataclass(frozen=True)
class DirectLayout:
    """Where each record of one HDF5 dataset lies in its file."""

    dtype: np.dtype            # the stored dtype (native byte order)
    row_bytes: int             # bytes of one record (all axes but the first)
    rows_per_chunk: int        # contiguous: every row; chunked: the chunk's first extent
    chunk_offsets: np.ndarray  # int64 file offset per chunk along the first axis (-1: none)

    def offset(self, row: int) -> int:
        """The file offset of record `row`; NO_OFFSET where its chunk was never written."""
        chunk, within = divmod(row, self.rows_per_chunk)
        base = int(self.chunk_offsets[chunk])
        return NO_OFFSET if base < 0 else base + within * self.row_bytes

    @functools.cached_property
    def by_row(self) -> array.array | _ByRow:
        """`by_row[row]` = `offset(row)`: a table of every row's offset (8 bytes a row,
        built once; a plain index per record in a read's per-record loop, about 10x
        cheaper than `offset`) within TABLE_ROWS and TABLE_BUDGET, else `offset` itself."""
        rows = len(self.chunk_offsets) * self.rows_per_chunk
        with _KNOWN_LOCK:
            if rows > TABLE_ROWS or _tables["bytes"] + 8 * rows > TABLE_BUDGET:
                return _ByRow(self.offset)
            _tables["bytes"] += 8 * rows
        table = array.array("q")
        table.frombytes(self.offsets(np.arange(rows)).astype(np.int64).tobytes())
        weakref.finalize(table, _release_table, 8 * rows)
        return table

    def offsets(self, rows: np.ndarray) -> np.ndarray:
        """File offsets (int64) of `rows`; NO_OFFSET where the chunk was never written."""
        chunk, within = np.divmod(np.asarray(rows, dtype=np.int64), self.rows_per_chunk)
        base = self.chunk_offsets[chunk]
        return np.where(base < 0, NO_OFFSET, base + within * self.row_bytes)

    @classmethod
    def of(cls, dataset: Any, fd: int) -> DirectLayout | None:
        """The layout of `dataset` (an h5py Dataset, or an h5netcdf Variable over one),
        checked against h5py through `fd`; None where records cannot be read directly."""
        dataset = getattr(dataset, "_h5ds", dataset)        # h5netcdf keeps the h5py one
        if not isinstance(dataset, h5py.Dataset):
            return None
        try:
            st = os.fstat(fd)
            key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, dataset.name)
            with _KNOWN_LOCK:
                if key in _KNOWN:
                    _KNOWN.move_to_end(key)
                    return _KNOWN[key]
            layout = cls._find(dataset)
            if layout is not None and not layout._agrees(dataset, fd):
                layout = None
        except (OSError, RuntimeError, ValueError, TypeError, AttributeError):
            return None                                     # h5py without the query, etc.
        with _KNOWN_LOCK:
            _KNOWN[key] = layout
            while len(_KNOWN) > KNOWN_LAYOUTS:
                _KNOWN.popitem(last=False)
        return layout

    @classmethod
    def _find(cls, dataset: h5py.Dataset) -> DirectLayout | None:
        dtype, shape = dataset.dtype, dataset.shape
        if (dtype.kind not in "iuf" or not dtype.isnative or len(shape) < 1 or shape[0] == 0
                or dataset.file.driver != "sec2"):
            return None
        plist = dataset.id.get_create_plist()
        if plist.get_nfilters() or plist.get_external_count():
            return None
        row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
        kind = plist.get_layout()
        if kind == h5py.h5d.CONTIGUOUS:
            base = dataset.id.get_offset()
            if base is None:
                return None
            return cls(dtype, row_bytes, shape[0], np.array([base], dtype=np.int64))
        if kind != h5py.h5d.CHUNKED or tuple(dataset.chunks[1:]) != tuple(shape[1:]):
            return None
        per_chunk = int(dataset.chunks[0])
        offsets = np.full(-(-shape[0] // per_chunk), NO_OFFSET, dtype=np.int64)

        def note(info: Any) -> None:
            if info.byte_offset is not None and info.size >= per_chunk * row_bytes:
                offsets[info.chunk_offset[0] // per_chunk] = info.byte_offset

        if hasattr(dataset.id, "chunk_iter"):
            dataset.id.chunk_iter(note)
        else:
            for i in range(dataset.id.get_num_chunks()):
                note(dataset.id.get_chunk_info(i))
        return cls(dtype, row_bytes, per_chunk, offsets)

    def _agrees(self, dataset: h5py.Dataset, fd: int) -> bool:
        """The first and last records with an offset read the same bytes both ways."""
        rows = np.flatnonzero(self.offsets(np.arange(dataset.shape[0])) >= 0)
        for row in {int(rows[0]), int(rows[-1])} if rows.size else ():
            mine = np.empty(dataset.shape[1:], dtype=dataset.dtype)
            read_jobs([(fd, mine, self.offset(row))], self.row_bytes)
            if mine.tobytes() != np.asarray(dataset[row]).tobytes():
                return False
        return True


def _release_table(nbytes: int) -> None:
    with _KNOWN_LOCK:
        _tables["bytes"] -= nbytes


class _ByRow:
    """`by_row[row]` through `DirectLayout.offset` (a dataset too long for a table)."""

    def __init__(self, offset: Any):
        self._offset = offset

    def __getitem__(self, row: int) -> int:
        return self._offset(row)


@dataclass(frozen=True)
class FileRecords:
    """The records of one HDF5 dataset, read through an open file descriptor: a caller
    reads record `row` with `read_jobs` at `(fd, buffer, layout.offset(row))`, together
    with the records of other files (ArraySource reads a whole call in one `read_jobs`)."""

    fd: int
    layout: DirectLayout

    @property
    def dtype(self) -> np.dtype:
        return self.layout.dtype

    def advise(self, rows: list[int]) -> None:
        """Tell the kernel that records `rows` will be read soon (`WILLNEED`): one range
        per run of records less than ADVISE_GAP bytes apart (neighbours in the file are
        fetched in one long read; at most ADVISE_GAP bytes between them come along)."""
        if WILLNEED is None or not len(rows):
            return
        offsets = np.sort(self.layout.offsets(np.asarray(rows, dtype=np.int64)))
        offsets = offsets[offsets >= 0]
        if not offsets.size:
            return
        size = self.layout.row_bytes
        cuts = np.flatnonzero(np.diff(offsets) > size + ADVISE_GAP) + 1
        firsts = offsets[np.concatenate([[0], cuts])]
        lasts = offsets[np.concatenate([cuts - 1, [offsets.size - 1]])]
        for lo, hi in zip(firsts.tolist(), lasts.tolist()):
            os.posix_fadvise(self.fd, lo, hi + size - lo, WILLNEED)


def read_cached(fd: int, buffer: Any, offset: int) -> int | None:
    """`preadv` of `buffer` at `offset` from the page cache only (`RWF_NOWAIT`): the bytes
    read, or None where they are not all cached or the file system cannot say (after its
    first refusal `RWF_NOWAIT` is not tried again). Both direct readers probe through it."""
    global _NOWAIT
    if _NOWAIT is None:
        return None
    try:
        return os.preadv(fd, [buffer], offset, _NOWAIT)
    except BlockingIOError:
        return None
    except OSError as e:                         # a file system without RWF_NOWAIT
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        _NOWAIT = None
        return None


def read_jobs(jobs: list[tuple[int, np.ndarray, int]], row_bytes: int) -> int:
    """Read each job's `row_bytes` bytes at (file descriptor, offset) into its buffer (a
    C-contiguous record). Records already in the page cache are copied at once
    (`RWF_NOWAIT`); the others are announced to the kernel together (`WILLNEED`), so that
    they are fetched concurrently, then read. Returns how many were not in the page cache
    (all of them where the file system cannot say). Raises ShortRead naming the job whose
    file ends early or whose read fails (EIO, ...)."""
    misses = []
    k = off = 0
    try:
        if _NOWAIT is not None:
            nowait = _NOWAIT
            try:
                for k, (fd, buffer, off) in enumerate(jobs):  # the hot loop: only preadv
                    try:
                        if os.preadv(fd, [buffer], off, nowait) != row_bytes:
                            misses.append(k)
                    except BlockingIOError:
                        misses.append(k)
            except OSError as e:          # a file system without RWF_NOWAIT: read_cached
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):     # turns it off
                    raise
                misses = [k for k, (fd, buffer, off) in enumerate(jobs)
                          if read_cached(fd, buffer, off) != row_bytes]
        else:
            misses = list(range(len(jobs)))
        if WILLNEED is not None and len(misses) > 1:
            for k in misses:
                os.posix_fadvise(jobs[k][0], jobs[k][2], row_bytes, WILLNEED)
        for k in misses:
            fd, buffer, off = jobs[k]
            got = os.preadv(fd, [buffer], off)
            if got != row_bytes:
                raise ShortRead(k, f"read {got} of {row_bytes} bytes at offset {off} (the "
                                   f"file is shorter than its HDF5 metadata says: truncated?)")
    except ShortRead:
        raise
    except OSError as e:
        raise ShortRead(k, f"reading {row_bytes} bytes at offset {off} failed: {e}") from e
    return len(misses)
