"""How ArraySource reads the records of one `rows` call into the batch buffers.

Three paths, tried in this order for each field (spmd.data.sources.arrays holds the rest of the
source: order, members, checks):
1. Whole records straight from the files' bytes, where the bytes on disk are the values:
   uncompressed HDF5 / NetCDF4 (spmd.data.formats.direct_reads: one pread per record) and Zarr v3
   arrays of one record per chunk (spmd.data.formats.zarr_chunks: one chunk file per record).
2. Zarr reads left over (slabs, sharded arrays, fill values): one orthogonal selection per
   array, all of a call's in one round trip to zarr's event loop.
3. HDF5 (through h5py) and .npy memory maps: one selection per record.

Invariants:
- The three paths give the same values; which one runs never changes a batch.
- Every error names the file, the record, the dataset path and the config key
  (`_read_error` of the source).
- Readahead: after a direct read that missed the page cache, each call announces to the
  kernel the records of rows [start, stop) of the steps up to `READAHEAD_STEPS` ahead,
  (with blocks, data.shuffle_block: up to the end of the group of data.shuffle_mix blocks
  after the one that step falls in)
  once each and never at or past `prefetch_until`, until `COLD_STEPS` steps after the last
  call that missed for a quarter of its records or more; reads that hit the cache announce
  nothing. The announcing runs in one readahead thread per source, in call order (with
  blocks, a group at a time, the group being read first); `close` stops it.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from spmd.data.formats import direct_reads
from spmd.data.formats.direct_reads import FileRecords, ShortRead
from spmd.data.formats.stores import Store
from spmd.data.order import BlockOrder

__all__ = ["RecordReads"]


class RecordReads:
    """The reading half of spmd.data.sources.arrays.ArraySource (a mixin: it uses the source's
    index, members, datasets and errors)."""

    # Readahead: after a direct read that missed the page cache, every call announces the
    # records of the steps up to READAHEAD_STEPS ahead (posix_fadvise WILLNEED), as the
    # kernel's own readahead does for a sequential read, so that a cold shuffled read keeps
    # several steps of I/O in flight; this goes on until COLD_STEPS steps after the last
    # miss (announced records hit the cache, so a hit says nothing). Nothing is announced
    # while reads hit the cache.
    # The kernel is told in a thread of the source's own ("spmd-readahead"): posix_fadvise
    # submits the reads and costs 5-10 µs per record, off the reading thread's path.
    READAHEAD_STEPS = 8
    COLD_STEPS = 256
    COLD_SHARE = 4
    _announcer: ThreadPoolExecutor | None = None
    _announced: Future | None = None

    def _read_ahead(self, step: int, start: int, stop: int, missed: int) -> None:
        """Tell the kernel the records of rows [start, stop) of the steps up to
        READAHEAD_STEPS ahead of `step` (those not told yet), while reads are cold: a call
        missed the page cache for at least 1 in COLD_SHARE of its records less than
        COLD_STEPS steps ago (a warm file still misses now and then: a page the kernel
        marked for its own readahead refuses RWF_NOWAIT once)."""
        with self._lock:
            if missed and missed * self.COLD_SHARE >= stop - start:
                self._cold_until = max(self._cold_until, step + self.COLD_STEPS)
            if step > self._cold_until:
                return
            first = max(step, self._advised.get((start, stop), step)) + 1
            last = self._block_end(step + self.READAHEAD_STEPS)
            if self.prefetch_until is not None:
                last = min(last, self.prefetch_until - 1)
            if first > last:
                return
            self._advised[(start, stop)] = last
            if self._announcer is None:      # one thread: the calls' order is kept
                self._announcer = ThreadPoolExecutor(1, thread_name_prefix="spmd-readahead")
            self._announced = self._announcer.submit(self._announce, first, last, start, stop)

    def _block_end(self, step: int) -> int:
        """`step`, or with blocks (data.shuffle_block) the last step of the group visit after
        the one that `step` starts in: the readahead then tells whole blocks' records,
        which lie in one stretch of each file each (FileRecords.advise merges them into
        long reads), one group of data.shuffle_mix blocks ahead, so that the next group
        arrives while this one is read."""
        order = self.index
        if not isinstance(order, BlockOrder):
            return step
        end = order.group_end(order.group_end(step * self.batch_size))
        return max(step, (end - 1) // self.batch_size)

    def _group_runs(self, first: int, last: int) -> list[tuple[int, int]]:
        """Steps first..last cut where a group of blocks ends (one run without blocks): the
        kernel is told a group at a time, in reading order, so that this group's records
        are not queued behind the next one's (records within a run go in file order)."""
        order = self.index
        if not isinstance(order, BlockOrder):
            return [(first, last)]
        runs, step = [], first
        while step <= last:
            end = order.group_end(step * self.batch_size)
            runs.append((step, min(last, max(step, (end - 1) // self.batch_size))))
            step = runs[-1][1] + 1
        return runs

    def _announce(self, first: int, last: int, start: int, stop: int) -> None:
        """In the readahead thread: tell the kernel the records of rows [start, stop) of
        steps first..last, a group of blocks at a time. Advice only: a member that cannot
        be opened or read now is named by the read that needs it, so errors here are
        dropped."""
        try:
            for lo, hi in self._group_runs(first, last):
                found = self.index.records(np.concatenate(
                    [np.asarray(self.positions(t, start, stop)) for t in range(lo, hi + 1)]))
                for name in self.fields:
                    members, rows = self.place(name, found)
                    for m in np.unique(members).tolist():
                        with self._member(m) as store:
                            reader = store.direct(self.datasets[name],
                                                  self.field_key(name))
                            if reader is not None:
                                reader.advise(rows[members == m].tolist())
        except Exception:  # noqa: BLE001 - advice; the read itself raises what is wrong
            pass

    def wait_announced(self) -> None:
        """Block until the readahead told so far has reached the kernel (for tests)."""
        with self._lock:
            announced = self._announced
        if announced is not None:
            announced.result()

    def _stop_announcing(self) -> None:
        with self._lock:
            announcer, self._announcer, self._announced = self._announcer, None, None
        if announcer is not None:
            announcer.shutdown(wait=True, cancel_futures=True)

    def _read_direct(self, value: np.ndarray, name: str, key: str, members: np.ndarray,
                     rows: np.ndarray, stores: dict[int, Store], records: list[int]
                     ) -> tuple[list[int], int, int]:
        """Whole records straight from the files' bytes into `value` (uncompressed HDF5 /
        NetCDF4: spmd.data.formats.direct_reads, every member's records of the call in one
        `read_jobs`; Zarr v3, one record per chunk: spmd.data.formats.zarr_chunks, per member);
        `members` and `rows` are int arrays, one entry per batch row. Returns the batch rows
        left to read otherwise (other layouts, never-written chunks), the bytes read and how
        many records were not in the page cache."""
        flat = value.reshape(len(rows), -1)
        buffers = list(flat)                       # one view per batch row
        member_of, row_of = members.tolist(), rows.tolist()
        dataset = self.datasets[name]
        readers = {}
        for m in set(member_of):                   # a cast reads through the library
            readers[m] = stores[m].direct(dataset, key) \
                if stores[m].dtype(dataset, key) == value.dtype else None
        files = {m: (r.fd, r.layout.by_row) for m, r in readers.items()
                 if isinstance(r, FileRecords)}
        jobs, placed, left = [], [], []
        by_member: dict[int, list[int]] = {}       # readers of their own (Zarr chunk files)
        for i, m in enumerate(member_of):          # per record: no NumPy call, no grouping
            file = files.get(m)
            if file is not None:
                off = file[1][row_of[i]]
                if off < 0:
                    left.append(i)
                else:
                    jobs.append((file[0], buffers[i], off))
                    placed.append(i)
            elif readers[m] is None:
                left.append(i)
            else:
                by_member.setdefault(m, []).append(i)
        try:
            missed = direct_reads.read_jobs(jobs, flat.shape[1] * value.itemsize) if jobs else 0
        except ShortRead as e:
            i = placed[e.job]
            raise self._read_error(name, member_of[i], [records[i]], [row_of[i]], e) from None
        done = len(jobs)
        for m, batch_rows in by_member.items():
            try:
                unread, cold = readers[m].read([row_of[i] for i in batch_rows],
                                               [buffers[i] for i in batch_rows])
            except ShortRead as e:
                i = batch_rows[e.job]
                raise self._read_error(name, m, [records[i]], [row_of[i]], e) from None
            except OSError as e:
                raise self._read_error(name, m, [records[i] for i in batch_rows],
                                       [row_of[i] for i in batch_rows], e) from None
            left += [batch_rows[k] for k in unread]
            done += len(batch_rows) - len(unread)
            missed += cold
        return sorted(left), done * flat.shape[1] * value.itemsize, missed

    def _read_zarr(self, reads: list[tuple[np.ndarray, list[tuple[int, int]], Any,
                                           tuple[slice, ...], str, int]],
                   records: list[int]) -> int:
        """Every Zarr read of one call, [(value, [(batch row, row)], array, index, field,
        member)], as one orthogonal selection per array and all of them in one round trip
        to zarr's event loop: the chunks of the whole call are fetched concurrently (a
        round trip per selection costs more than a 16 KiB chunk). The bytes read."""
        from zarr.core.sync import sync

        wanted = [sorted({row for _, row in items}) for _, items, *_ in reads]

        async def gather() -> list[Any]:
            return await asyncio.gather(*(
                array.async_array.get_orthogonal_selection((np.asarray(rows), *index))
                for (_, _, array, index, _, _), rows in zip(reads, wanted)),
                return_exceptions=True)

        nbytes = 0
        for (value, items, _, _, name, member), rows, got in zip(reads, wanted, sync(gather())):
            if isinstance(got, OSError | KeyError | RuntimeError | ValueError):
                raise self._read_error(name, member, [records[i] for i, _ in items],
                                       [row for _, row in items], got) from None
            if isinstance(got, BaseException):
                raise got
            got = np.asarray(got)
            at = {row: k for k, row in enumerate(rows)}
            for i, row in items:
                value[i] = got[at[row]].reshape(value.shape[1:])
            nbytes += got.nbytes
        return nbytes

    def _read_into(self, value: np.ndarray, items: list[tuple[int, int]], array: Any,
                   fmt: str, index: tuple[slice, ...], name: str, member: int,
                   records: list[int]) -> int:
        """Rows `items` ([(batch row, row in the member)]) of `array`, each cut to `index`,
        into `value`; the bytes read: HDF5 (what direct reads leave) and .npy row by row
        (h5py: one hyperslab per record is the fastest selection)."""
        shape = value.shape[1:]
        nbytes = 0
        for i, row in items:
            try:
                got = np.asarray(array[(row, *index)])
            except (OSError, KeyError, RuntimeError, ValueError) as e:  # a damaged chunk
                raise self._read_error(name, member, [records[i]], [row], e) from None
            value[i] = got.reshape(shape)
            nbytes += got.nbytes
        return nbytes
