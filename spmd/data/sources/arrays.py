"""Named fields of on-disk arrays as a deterministic DataSource for scientific data.

A dataset is one store or many (spmd.data.formats.stores: HDF5, NetCDF4, Zarr, directories of .npy
files; spmd.data.formats.file_index: a directory or glob of stores, concatenated along the first
axis) holding one array per field, examples along the first axis: e.g.
`{"u0": "train/u0", "u1": "train/u1"}` names the dataset path of each batch field.

Invariants:
- Global row `r` of step `s` is record `order[s * batch_size + r]`, where `order` is
  the split's seeded shuffle (file order with `shuffle=False`): `shuffle_block` =
  data.shuffle_block blocks of consecutive records (auto: about 4 MiB of them; full: no
  blocks, grain's epoch-wise shuffle), visited `shuffle_mix` = data.shuffle_mix at a time,
  the records of those shuffled together, repeated forever (spmd.data.order computes it, a
  batch at a time):
  a pure function of (seed, step, row), the same for any process count. The position is
  the step, which the checkpoint holds: a resumed run reads the same batches.
- Record `i` of a multi-file dataset is row `i - offset[f]` of the member `f` that holds it
  (members in sorted path order): the same records, in the same order, as one file with
  the members' rows concatenated.
- `rows(step, start, stop, region)` reads only the records of rows [start, stop), and of
  each record only `region[field]` (a half-open index range per example axis): one
  hyperslab read (chunked formats) or memmap slice per record and field; whole records of
  uncompressed HDF5 / NetCDF4 datasets (spmd.data.formats.direct_reads: one pread each) and of
  Zarr v3 arrays of one record per chunk (spmd.data.formats.zarr_chunks: one chunk file each) are
  read straight from the files' bytes instead, with the same values. `reads_slabs =
  True` tells the feed (spmd.data.loader.feed) that it may ask for a process's slab of a
  spatially split field.
- Members are opened lazily, when a row they hold is read (at most `max_open` at once);
  `opened_files` lists them. The index (record counts and shapes) comes from the cached
  index file, so a process opens only the files that hold its rows.
- A stored example has the field's `BatchField.example_shape`, or that shape without a
  trailing channel axis of size 1 (added on read). Values are cast to the field's dtype.
- CF-coded NetCDF4 / Zarr variables are decoded as xarray decodes them
  (spmd.data.cf.cf_decode): `scale_factor`, `add_offset`, and `_FillValue` / `missing_value`
  become NaN; per member file (the attributes may differ between files), then cast to the
  field's dtype. A packed dtype the field's dtype cannot hold exactly (int32 packing in a
  float32 field) is refused.
- Every error names the file, the dataset path and the config key to change.
- `rows` may be called from several threads at once (the feed's background reads); the
  source pickles without its open files.
- `prefetch`, `read_threads`, `prefetch_until` tell the feed how to read ahead (0: not).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from spmd.data.batch import BatchField
from spmd.data.buffer_pool import BufferPool
from spmd.data.cf.cf_decode import CF_FORMATS, Coding, decode, stored_coding
from spmd.data.data_config import SourceSections
from spmd.data.formats.file_index import FileIndex, load_index
from spmd.data.formats.member_leases import MemberLeases
from spmd.data.formats.stores import ArrayDataError, Store, detect_format, write_arrays
from spmd.data.order import BlockOrder, EpochOrder, make_order
from spmd.data.reads.record_reads import RecordReads

__all__ = ["ArrayDataError", "ArraySource", "Region", "store_format", "write_arrays"]

Region = tuple[tuple[int, int], ...]   # [lo, hi) per example axis of one field


def store_format(path: Path) -> str:
    """'hdf5', 'netcdf', 'zarr' or 'npy', by what is on disk."""
    return detect_format(path)


class ArraySource(RecordReads, MemberLeases):
    """The DataSource of named on-disk array fields; rows [start, stop) of the global batch.

    `datasets` maps each batch field to its dataset path in the store(s); `fields` are the
    task's BatchFields (shape, dtype; the first axis is the batch). `count` limits the
    records used (default: all). `config_key` / `fields_key` name the config keys (or the
    command-line flags) that errors tell the user to change. `path` is a store, a directory
    of stores or a glob.
    """

    reads_slabs = True

    def __init__(self, path: str | Path, datasets: Mapping[str, str],
                 fields: Mapping[str, BatchField], batch_size: int, *, seed: int = 0,
                 shuffle: bool = True, count: int | None = None,
                 config_key: str = "data.path", fields_key: str = "data.fields",
                 prefetch: int = 0, read_threads: int = 1, prefetch_until: int | None = None,
                 max_open: int = 64, shuffle_block: int | str | None = "auto",
                 shuffle_mix: int = 16):
        self.path, self.batch_size = Path(path), int(batch_size)
        self.datasets, self.fields = dict(datasets), dict(fields)
        self.where = f"{config_key}={path}"
        self.fields_key = fields_key
        self.prefetch, self.read_threads = int(prefetch), max(1, int(read_threads))
        self.prefetch_until, self.max_open = prefetch_until, max(1, int(max_open))
        self.shuffle_block, self.shuffle_mix = shuffle_block, int(shuffle_mix)
        if not (shuffle_block in (None, "auto", "full") or
                isinstance(shuffle_block, int) and shuffle_block >= 1):
            raise ArrayDataError(f"data.shuffle_block={shuffle_block}: give a number of "
                                 f"records of 1 or more, auto (blocks of about 4 MiB) or "
                                 f"full (a full shuffle)")
        if self.shuffle_mix < 1:
            raise ArrayDataError(f"data.shuffle_mix={shuffle_mix}: give the number of blocks "
                                 f"read at a time, 1 or more")
        missing = sorted(set(self.fields) - set(self.datasets))
        if missing:
            raise ArrayDataError(f"{self.where}: no dataset path for batch field(s) {missing}; "
                                 f"set {fields_key}.<field> (have {sorted(self.datasets)})")
        self._count, self._seed, self._shuffle = count, seed, shuffle
        self._setup()
        self.records_read = 0                 # records x fields read by this process
        self.bytes_read = 0                   # bytes of those reads (after slab selection)
        self.last_reads: list[tuple[str, int, tuple[slice, ...]]] = []
        self.opened_files: list[str] = []     # members opened to read rows, in order
        self.reads_by_file: collections.Counter[str] = collections.Counter()

    def _setup(self) -> None:
        self._advised: dict[tuple[int, int], int] = {}     # rows -> last step told
        self._cold_until = -1                 # readahead runs up to this step (last miss + N)
        self._buffers = BufferPool()          # batch buffers, used again once released
        self._lock = threading.RLock()
        self._files: FileIndex | None = None
        self._offsets: dict[str, np.ndarray] = {}        # field -> cumulative record counts
        self._ndims: dict[str, int] = {}                  # field -> stored ndim (h5py's is slow)
        self._stores: collections.OrderedDict[int, Store] = collections.OrderedDict()
        self._names: list[str] | None = None              # member -> str(path), for counters
        self._busy: collections.Counter[int] = collections.Counter()
        self._order: Any = None
        self._checked = False
        self._codings: dict[tuple[int, str], Coding | None] = {}   # (member, dataset)

    def field_key(self, name: str) -> str:
        """What names field `name`'s dataset in messages: `<fields_key>.<name>` (data.fields.u),
        or `fields_key` itself when it is a command-line flag (`spmd predict --dataset`)."""
        return self.fields_key if self.fields_key.startswith("--") else f"{self.fields_key}.{name}"

    @classmethod
    def from_sections(cls, sections: SourceSections, split: str,
                      fields: Mapping[str, BatchField], defaults: Mapping[str, str], *,
                      shuffle: bool, count: int | None = None) -> ArraySource:
        """Split `split` of the config's data.path: each field's dataset path from
        data.fields (else `defaults`), with "{split}" filled in; seeded with train.seed.
        Reads ahead data.prefetch batches with data.read_threads threads: the train split
        up to train.steps, another split up to data.eval_batches."""
        d = sections.data
        if d.path is None:
            raise ArrayDataError(f"data.path is not set: the task {sections.task} reads its "
                                 f"fields from a file (made by `spmd data make CONFIG`)")
        unknown = sorted(set(d.fields) - set(fields))
        if unknown:
            raise ArrayDataError(f"data.fields names {unknown}, which are not batch fields "
                                 f"of the task {sections.task} (its fields: {sorted(fields)})")
        named = {name: d.fields.get(name) or defaults[name] for name in fields}
        same = sorted(name for name, path in named.items() if "{split}" not in path)
        if same and split != "train":
            key = (f"data.fields.{same[0]}" if d.fields.get(same[0])
                   else f"the task's dataset path for '{same[0]}'")
            raise ArrayDataError(
                f"{key}={named[same[0]]} has no {{split}}: the {split} split would read the "
                f"train split's records; store the splits in groups and write the path as "
                f"{{split}}/<name> (data.path={d.path})")
        paths = {name: path.format(split=split) for name, path in named.items()}
        until = sections.steps if split == "train" else d.eval_batches
        return cls(d.path, paths, fields, sections.batch_size, seed=sections.seed,
                   shuffle=shuffle, count=count,
                   prefetch=d.prefetch,
                   read_threads=d.read_threads, prefetch_until=until,
                   shuffle_block=d.shuffle_block, shuffle_mix=d.shuffle_mix)

    # --------------------------------------------------------- checks

    @property
    def count(self) -> int:
        """Records used (validates the store on first use)."""
        return self.check()

    @property
    def index(self) -> EpochOrder | BlockOrder:
        """Position in the endless stream -> record index (`index[p]`, `index.records`)."""
        if self._order is None:
            with self._lock:
                if self._order is None:
                    self._order = make_order(
                        self.check(), self._seed % 2**32, shuffle=self._shuffle,
                        block=self.shuffle_block, mix=self.shuffle_mix,
                        record_bytes=self.record_bytes)
        return self._order

    @property
    def record_bytes(self) -> int:
        """The bytes of one example, all fields (as the task declares them, whatever slab
        a process reads: the order is the same on every process)."""
        return sum(int(np.prod(f.example_shape)) * f.dtype.itemsize
                   for f in self.fields.values())

    @property
    def files(self) -> FileIndex:
        """The dataset's members (the cached index of a multi-file dataset)."""
        if self._files is None:
            with self._lock:
                if self._files is None:
                    self._files = load_index(self.path, self.where)
        return self._files

    @property
    def _path_names(self) -> list[str]:
        """Each member's path as the read counters name it."""
        if self._names is None:
            self._names = [str(m.path) for m in self.files.members]
        return self._names

    def check(self) -> int:
        """Check every dataset against its BatchField (once); the number of records used.
        Raises ArrayDataError naming file, dataset and key."""
        if not self._checked:
            with self._lock:
                if not self._checked:
                    self._count = self._check(self._count)
                    self._checked = True
        return int(self._count)

    def reads(self) -> dict[str, str]:
        """How each field's records are read from the first file, and why (`spmd data
        info`): "direct chunk reads: ...", "direct file reads: ...", or "through zarr: <why
        not directly>" / "through h5py: ..." / a cast through the library."""
        self.check()
        out = {}
        for name, field in self.fields.items():
            dataset, key = self.datasets[name], self.field_key(name)
            with self._member(0) as store:
                stored = store.dtype(dataset, key)
                how = store.reads(dataset, key)
            if stored != field.dtype and how.startswith("direct"):
                how = f"through the library: stored {stored}, read as {field.dtype}"
            out[name] = f"{dataset}: {how}"
        return out

    def describe_reads(self) -> str:
        """`reads()` as lines, one per field."""
        return "\n".join(f"reads {name} ({how})" for name, how in self.reads().items())

    def _where(self, member: int) -> str:
        files = self.files
        return f"{self.where}: file {files.members[member].path}" if files.multi else self.where

    def _shapes(self, name: str) -> list[tuple[int, ...]]:
        """The shape of field `name`'s dataset in every member."""
        files, dataset = self.files, self.datasets[name]
        key = self.field_key(name)
        if not files.multi:
            with self._member(0) as store:
                return [tuple(store.get(dataset, key).shape)]
        shapes = []
        for i, member in enumerate(files.members):
            if dataset not in member.datasets:
                raise ArrayDataError(f"{self._where(i)}: dataset '{dataset}' ({key}) is "
                                     f"missing; the file has {sorted(member.datasets)}")
            shapes.append(tuple(member.datasets[dataset][0]))
        return shapes

    def _check(self, count: int | None) -> int:
        """Every dataset exists and fits its BatchField; the records usable (all the same)."""
        counts = {}
        self._check_coding()
        for name, field in self.fields.items():
            key = self.field_key(name)
            want = field.example_shape
            shapes = self._shapes(name)
            for i, shape in enumerate(shapes):
                if shape[1:] != want and not (want[-1:] == (1,) and shape[1:] == want[:-1]):
                    raise ArrayDataError(
                        f"{self._where(i)}: dataset '{self.datasets[name]}' ({key}) has shape "
                        f"{shape}, i.e. examples of shape {shape[1:]}, but batch field "
                        f"'{name}' needs {want} (a trailing channel axis of 1 may be absent); "
                        f"check the model config or point {key} at another dataset"
                    )
            self._offsets[name] = np.cumsum([0] + [shape[0] for shape in shapes])
            counts[name] = int(self._offsets[name][-1])
        have = min(counts.values())
        if count is not None and count > have:
            raise ArrayDataError(f"{self.where}: {count} records wanted but dataset(s) hold "
                                 f"{counts}; lower the record count or make a larger file")
        if count is None and len(set(counts.values())) > 1:
            raise ArrayDataError(f"{self.where}: datasets hold different record counts "
                                 f"{counts}; give a count or fix the file")
        return have if count is None else int(count)

    def _check_coding(self) -> None:
        """The CF coding of every field in the first member, found now so that a variable
        that cannot be decoded (`_Unsigned`, int32 packing in a float32 field) is refused
        before training, naming file and variable."""
        member = self.files.members[0]
        if member.format not in CF_FORMATS:
            return
        store = Store(member.path, self._where(0), member.format, for_records=False)
        try:                                # metadata only: not a lease, no read counted
            for name in self.fields:
                try:
                    store.get(self.datasets[name], self.field_key(name))
                except ArrayDataError:
                    continue                # a missing dataset: _shapes says so
                self._coding(0, name, store)
        finally:
            store.close()

    def _coding(self, member: int, name: str, store: Store) -> Coding | None:
        """The CF coding of field `name`'s dataset in member `member` (open as `store`), or
        None when its values are read as stored; cached per member."""
        dataset = self.datasets[name]
        key = (member, dataset)
        if key in self._codings:
            coding = self._codings[key]
        else:
            coding = None
            if store.format in CF_FORMATS:
                array = store.get(dataset, self.field_key(name))
                coding = stored_coding(store.path, store.format, dataset,
                                       getattr(array, "attrs", None), self._where(member))
            with self._lock:
                self._codings[key] = coding
        field = self.fields[name]
        if coding is not None and not (np.can_cast(coding.raw_dtype, field.dtype, "safe")
                                       and np.can_cast(coding.dtype, field.dtype,
                                                       "same_kind")):
            raise ArrayDataError(
                f"{self._where(member)}: variable '{dataset}' ({self.field_key(name)}) is "
                f"stored as {coding.raw_dtype} with CF coding (decoded to {coding.dtype}), "
                f"which batch field '{name}' of dtype {field.dtype} cannot hold exactly "
                f"before decoding; rewrite it unpacked (xarray: encoding dtype float32)")
        return coding

    def _decode(self, name: str, value: np.ndarray, member_of: np.ndarray,
                stores: Mapping[int, Store]) -> None:
        """Decode in place the rows of `value` (field `name`) read from CF-coded members:
        the raw values, cast exactly to the field's dtype, go through xarray's steps
        (spmd.data.cf.cf_decode) and are cast back."""
        if not len(value):
            return
        for m in np.unique(member_of).tolist():
            coding = self._coding(int(m), name, stores[int(m)])
            if coding is not None:
                rows = np.flatnonzero(member_of == m)
                if len(rows) == len(value):
                    value[...] = decode(value, coding)
                else:
                    value[rows] = decode(value[rows], coding)

    def statistics_plan(self) -> dict[str, tuple[bool, int]]:
        """What `spmd data stats` computes for this source (spmd.data.stats.normalization): per
        distinct dataset path, (per_channel, rows). per_channel: every field stored there
        has the logical last axis "channels" and the stored array has that axis (not a
        trailing channel axis of 1 left out); rows: the records used (`count`)."""
        rows = self.count
        plan: dict[str, tuple[bool, int]] = {}
        for name, field in self.fields.items():
            dataset = self.datasets[name]
            stored = self._shapes(name)[0]
            per_channel = (field.axes[-1] == "channels"
                           and len(stored) == 1 + len(field.example_shape))
            if dataset in plan:
                per_channel = per_channel and plan[dataset][0]
            plan[dataset] = (per_channel, rows)
        return plan

    def locate(self, name: str, record: int) -> tuple[int, int]:
        """(member, row in that member) of record `record` of field `name`."""
        members, rows = self.place(name, np.array([record]))
        return int(members[0]), int(rows[0])

    def place(self, name: str, records: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(members, rows in those members) of `records` (an int array) of field `name`."""
        self.check()
        offsets = self._offsets[name]
        members = np.searchsorted(offsets, records, side="right") - 1
        return members, records - offsets[members]

    # --------------------------------------------------------- reading

    def positions(self, step: int, start: int, stop: int) -> range:
        base = step * self.batch_size
        return range(base + start, base + stop)

    def record_indices(self, step: int, start: int, stop: int) -> list[int]:
        """Which records rows [start, stop) of `step` are (for tests and logs)."""
        return self.index.records(self.positions(step, start, stop)).tolist()

    def files_for(self, step: int, start: int, stop: int) -> list[str]:
        """The members rows [start, stop) of `step` are read from (sorted)."""
        records = self.record_indices(step, start, stop)
        return sorted({str(self.files.members[self.locate(name, r)[0]].path)
                       for name in self.fields for r in records})

    def rows(self, step: int, start: int, stop: int,
             region: Mapping[str, Region | None] | None = None) -> dict[str, np.ndarray]:
        """Rows [start, stop) of step `step`; of field f only `region[f]` when given."""
        if not 0 <= start <= stop <= self.batch_size:
            raise ValueError(f"{self.where}: rows [{start}, {stop}) outside the batch of "
                             f"{self.batch_size}")
        self.check()
        found = self.index.records(self.positions(step, start, stop))
        records = found.tolist()
        placed = {name: self.place(name, found)
                  for name in self.fields}            # field -> (members, rows in them)
        reads: list[tuple[str, int, tuple[slice, ...]]] = []
        out, nbytes, per_file = {}, 0, collections.Counter()
        zarr_reads: list[tuple[np.ndarray, list[tuple[int, int]], Any, tuple[slice, ...], str,
                               int]] = []
        missed = 0                                    # direct reads not in the page cache
        counts = np.bincount(np.concatenate([members for members, _ in placed.values()]))
        with self._members(np.flatnonzero(counts).tolist()) as stores:  # leased together
            for name, field in self.fields.items():
                member_of, row_of = placed[name]
                box = (region or {}).get(name) or tuple((0, n) for n in field.example_shape)
                value = self._buffers.empty((len(records), *(hi - lo for lo, hi in box)),
                                            field.dtype)
                out[name] = value
                if not records:
                    continue
                key = self.field_key(name)
                ndim = self._ndims.get(name) or self._ndims.setdefault(
                    name, stores[int(member_of[0])].get(self.datasets[name], key).ndim)
                index = tuple(slice(lo, hi) for lo, hi in box[:ndim - 1])
                left: list[int] | range = range(len(records))
                if all(lo == 0 and hi == n for (lo, hi), n in zip(box, field.example_shape)):
                    left, got, cold = self._read_direct(value, name, key, member_of, row_of,
                                                        stores, records)
                    nbytes += got
                    missed += cold
                by_member: dict[int, list[tuple[int, int]]] = {}   # member -> [(i, row)]
                for i in left:
                    by_member.setdefault(int(member_of[i]), []).append((i, int(row_of[i])))
                for member, items in by_member.items():
                    store = stores[member]
                    array = store.get(self.datasets[name], key)
                    if store.format == "zarr":              # read below, all at once
                        zarr_reads.append((value, items, array, index, name, member))
                        continue
                    nbytes += self._read_into(value, items, array, store.format, index, name,
                                              member, records)
                reads += [(name, record, index) for record in records]
            if zarr_reads:
                nbytes += self._read_zarr(zarr_reads, records)
            for name in self.fields:                  # CF-coded members, as xarray decodes
                self._decode(name, out[name], placed[name][0], stores)
        for member in stores:
            per_file[self._path_names[member]] += int(counts[member])
        self._count_reads(reads, nbytes, per_file)
        self._read_ahead(step, start, stop, missed)
        return out

    def _count_reads(self, reads: list[tuple[str, int, tuple[slice, ...]]], nbytes: int,
                     per_file: collections.Counter[str]) -> None:
        """Add one `rows` call's reads to the counters (thread safe)."""
        with self._lock:
            self.records_read += len(reads)
            self.bytes_read += nbytes
            self.reads_by_file.update(per_file)
            self.last_reads = reads

    def _read_error(self, name: str, member: int, records: list[int], rows: list[int],
                    e: Exception) -> ArrayDataError:
        what = (f"record {records[0]}" if len(records) == 1 else
                f"records {sorted(records)[:8]}{' ...' if len(records) > 8 else ''}")
        if self.files.multi:
            what += (f" (row {rows[0]} of the file)" if len(rows) == 1 else
                     f" (rows {sorted(rows)[:8]}{' ...' if len(rows) > 8 else ''} of the file)")
        return ArrayDataError(
            f"{self._where(member)}: reading {what} of dataset '{self.datasets[name]}' "
            f"({self.field_key(name)}) failed ({type(e).__name__}: {e}); the file may be "
            f"truncated or corrupt (left unchanged)")

    def close(self) -> None:
        self._stop_announcing()
        with self._lock:
            for store in self._stores.values():
                store.close()
            self._stores.clear()
            self._busy.clear()

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        for k in ("_lock", "_files", "_offsets", "_ndims", "_stores", "_names", "_busy",
                  "_order", "_checked", "_announcer", "_announced", "_buffers", "_codings"):
            state.pop(k, None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._setup()

