"""Named fields of on-disk arrays (HDF5 files or directories of NumPy .npy files) as a
deterministic DataSource for scientific data.

A dataset is one *store* (an HDF5 file, or a directory holding `<dataset>.npy` files that
are memory-mapped) holding one array per field, examples along the first axis: e.g.
`{"u0": "train/u0", "u1": "train/u1"}` names the dataset path of each batch field.

Invariants:
- Global row `r` of step `s` is record `index[s * batch_size + r]`, where `index` is
  grain's epoch-wise seeded shuffle of the split (or file order, `shuffle=False`) repeated
  forever: a pure function of (seed, step, row), the same for any process count. The
  position is the step, which the checkpoint holds: a resumed run reads the same batches.
- `rows(step, start, stop, region)` reads only the records of rows [start, stop), and of
  each record only `region[field]` (a half-open index range per example axis): one
  hyperslab read (h5py) or memmap slice per record and field. `reads_slabs = True` tells
  the feed (spmd.data.feed) that it may ask for a process's slab of a spatially split field.
- A stored example has the field's `BatchField.example_shape`, or that shape without a
  trailing channel axis of size 1 (added on read). Values are cast to the field's dtype.
- Every error names the file, the dataset path and the config key to change.
- The store is opened lazily, once per process; the source pickles without it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import grain
import h5py
import numpy as np

from spmd.data.batch import BatchField
from spmd.errors import SpmdError

Region = tuple[tuple[int, int], ...]   # [lo, hi) per example axis of one field


class ArrayDataError(SpmdError):
    """A dataset file, dataset path or shape that does not fit the task's batch fields."""


# ---------------------------------------------------------------- stores


def store_format(path: Path) -> str:
    """'hdf5' for a file, 'npy' for a directory of .npy files (by what is on disk)."""
    return "npy" if Path(path).is_dir() else "hdf5"


class _Store:
    """An open dataset file: `get(dataset)` returns an array-like (shape, dtype, slicing)."""

    def __init__(self, path: Path, where: str):
        self.path, self.where = Path(path), where
        if not self.path.exists():
            raise ArrayDataError(
                f"{where}: no such file or directory on this host (make it with `spmd data "
                f"make CONFIG`; with several nodes it must be on a file system every rank sees)"
            )
        self.format = store_format(self.path)
        self._h5: h5py.File | None = None
        self._arrays: dict[str, Any] = {}
        if self.format == "hdf5":
            if not h5py.is_hdf5(self.path):
                raise ArrayDataError(f"{where}: not an HDF5 file (nor a directory of .npy "
                                     f"files); the file was left unchanged")
            try:
                self._h5 = h5py.File(self.path, "r")
            except OSError as e:   # file systems without flock (common on parallel ones)
                if "lock" not in str(e).lower():
                    raise ArrayDataError(f"{where}: cannot open the HDF5 file ({e})") from None
                self._h5 = h5py.File(self.path, "r", locking=False)

    def get(self, dataset: str, key: str) -> Any:
        """The array at `dataset`, or an error naming file, dataset path and config key."""
        if dataset not in self._arrays:
            self._arrays[dataset] = self._find(dataset, key)
        return self._arrays[dataset]

    def _find(self, dataset: str, key: str) -> Any:
        if self._h5 is not None:
            try:
                node = self._h5.get(dataset)
            except (OSError, KeyError, RuntimeError) as e:  # h5py: KeyError for a bad header
                raise ArrayDataError(
                    f"{self.where}: HDF5 dataset '{dataset}' ({key}) cannot be read "
                    f"({type(e).__name__}: {e}); the file may be truncated or corrupt "
                    f"(left unchanged)") from None
            if not isinstance(node, h5py.Dataset):
                raise ArrayDataError(
                    f"{self.where}: HDF5 dataset '{dataset}' ({key}) is missing; the file has "
                    f"{_h5_datasets(self._h5)}"
                )
            return node
        file = self.path / f"{dataset}.npy"
        if not file.is_file():
            have = sorted(str(p.relative_to(self.path))[:-4] for p in self.path.rglob("*.npy"))
            raise ArrayDataError(f"{self.where}: dataset '{dataset}' ({key}) is missing: no "
                                 f"file {file}; the directory has {have}")
        return np.load(file, mmap_mode="r")

    def close(self) -> None:
        self._arrays.clear()
        if self._h5 is not None:
            self._h5.close()
            self._h5 = None


def _h5_datasets(f: h5py.File) -> list[str]:
    names: list[str] = []
    f.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
    return sorted(names)


def write_arrays(path: Path, arrays: Mapping[str, np.ndarray],
                 attrs: Mapping[str, Any] | None = None, *, format: str = "hdf5",
                 chunks: Mapping[str, tuple[int, ...]] | None = None) -> Path:
    """Write `{dataset path: array}` as an HDF5 file (`format="npy"`: a directory of .npy
    files, without attrs), atomically: a temporary name in the same directory, renamed when
    complete. HDF5 datasets are chunked one example per chunk unless `chunks` says."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    if format not in ("hdf5", "npy"):
        raise ValueError(f"write_arrays: format {format!r} is not 'hdf5' or 'npy'")
    if format == "npy":
        tmp.mkdir()
        for name, value in arrays.items():
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            np.save(tmp / f"{name}.npy", np.ascontiguousarray(value))
        os.replace(tmp, path)
        return path
    try:
        with h5py.File(tmp, "w") as f:
            f.attrs.update(dict(attrs or {}))
            for name, value in arrays.items():
                chunk = (chunks or {}).get(name, (1, *value.shape[1:]))
                f.create_dataset(name, data=value, chunks=chunk)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


# ---------------------------------------------------------------- the source


class ArraySource:
    """The DataSource of named on-disk array fields; rows [start, stop) of the global batch.

    `datasets` maps each batch field to its dataset path in the store; `fields` are the
    task's BatchFields (shape, dtype; the first axis is the batch). `count` limits the
    records used (default: all). `config_key` / `fields_key` name the config keys that
    errors tell the user to change.
    """

    reads_slabs = True

    def __init__(self, path: str | Path, datasets: Mapping[str, str],
                 fields: Mapping[str, BatchField], batch_size: int, *, seed: int = 0,
                 shuffle: bool = True, count: int | None = None,
                 config_key: str = "data.path", fields_key: str = "data.fields"):
        self.path, self.batch_size = Path(path), int(batch_size)
        self.datasets, self.fields = dict(datasets), dict(fields)
        self.where = f"{config_key}={self.path}"
        self.fields_key = fields_key
        missing = sorted(set(self.fields) - set(self.datasets))
        if missing:
            raise ArrayDataError(f"{self.where}: no dataset path for batch field(s) {missing}; "
                                 f"set {fields_key}.<field> (have {sorted(self.datasets)})")
        self._store: _Store | None = None
        self._count, self._seed, self._shuffle = count, seed, shuffle
        self._index: Any = None
        self._checked = False
        self.records_read = 0                 # records x fields read by this process
        self.bytes_read = 0                   # bytes of those reads (after slab selection)
        self.last_reads: list[tuple[str, int, tuple[slice, ...]]] = []

    @classmethod
    def from_config(cls, cfg: Any, split: str, fields: Mapping[str, BatchField],
                    defaults: Mapping[str, str], *, shuffle: bool,
                    count: int | None = None) -> ArraySource:
        """Split `split` of the config's data.path: each field's dataset path from
        data.fields (else `defaults`), with "{split}" filled in; seeded with train.seed."""
        if cfg.data.path is None:
            raise ArrayDataError(f"data.path is not set: the task {cfg.task} reads its "
                                 f"fields from a file (made by `spmd data make CONFIG`)")
        unknown = sorted(set(cfg.data.fields) - set(fields))
        if unknown:
            raise ArrayDataError(f"data.fields names {unknown}, which are not batch fields "
                                 f"of the task {cfg.task} (its fields: {sorted(fields)})")
        paths = {name: (cfg.data.fields.get(name) or defaults[name]).format(split=split)
                 for name in fields}
        return cls(cfg.data.path, paths, fields, cfg.train.batch_size, seed=cfg.train.seed,
                   shuffle=shuffle, count=count)

    # --------------------------------------------------------- checks

    @property
    def count(self) -> int:
        """Records used (validates the store on first use)."""
        return self.check()

    @property
    def index(self) -> Any:
        """Position in the endless stream -> record index (grain MapDataset)."""
        if self._index is None:
            index = grain.MapDataset.range(self.check())
            if self._shuffle:
                index = index.shuffle(seed=self._seed % 2**32)
            self._index = index.repeat()
        return self._index

    def check(self) -> int:
        """Open the store and check every dataset against its BatchField (once); the
        number of records used. Raises ArrayDataError naming file, dataset and key."""
        if not self._checked:
            self._count = self._check(self._count)
            self._checked = True
        return int(self._count)

    def _open(self) -> _Store:
        if self._store is None:
            self._store = _Store(self.path, self.where)
        return self._store

    def _check(self, count: int | None) -> int:
        """Every dataset exists and fits its BatchField; the records usable (all the same)."""
        store = self._open()
        counts = {}
        for name, field in self.fields.items():
            key = f"{self.fields_key}.{name}"
            array = store.get(self.datasets[name], key)
            shape, want = tuple(array.shape), field.example_shape
            if shape[1:] != want and not (want[-1:] == (1,) and shape[1:] == want[:-1]):
                raise ArrayDataError(
                    f"{self.where}: dataset '{self.datasets[name]}' ({key}) has shape {shape}, "
                    f"i.e. examples of shape {shape[1:]}, but batch field '{name}' needs "
                    f"{want} (a trailing channel axis of 1 may be absent); check the model "
                    f"config or point {key} at another dataset"
                )
            counts[name] = shape[0]
        have = min(counts.values())
        if count is not None and count > have:
            raise ArrayDataError(f"{self.where}: {count} records wanted but dataset(s) hold "
                                 f"{counts}; lower the record count or make a larger file")
        if count is None and len(set(counts.values())) > 1:
            raise ArrayDataError(f"{self.where}: datasets hold different record counts "
                                 f"{counts}; give a count or fix the file")
        return have if count is None else int(count)

    # --------------------------------------------------------- reading

    def positions(self, step: int, start: int, stop: int) -> range:
        base = step * self.batch_size
        return range(base + start, base + stop)

    def record_indices(self, step: int, start: int, stop: int) -> list[int]:
        """Which records rows [start, stop) of `step` are (for tests and logs)."""
        return [int(self.index[p]) for p in self.positions(step, start, stop)]

    def rows(self, step: int, start: int, stop: int,
             region: Mapping[str, Region | None] | None = None) -> dict[str, np.ndarray]:
        """Rows [start, stop) of step `step`; of field f only `region[f]` when given."""
        if not 0 <= start <= stop <= self.batch_size:
            raise ValueError(f"{self.where}: rows [{start}, {stop}) outside the batch of "
                             f"{self.batch_size}")
        store, records = self._open(), self.record_indices(step, start, stop)
        self.last_reads = []
        out = {}
        for name, field in self.fields.items():
            array = store.get(self.datasets[name], f"{self.fields_key}.{name}")
            box = (region or {}).get(name) or tuple((0, n) for n in field.example_shape)
            stored_ndim = array.ndim - 1
            index = tuple(slice(lo, hi) for lo, hi in box[:stored_ndim])
            shape = tuple(hi - lo for lo, hi in box)
            value = np.empty((len(records), *shape), dtype=field.dtype)
            for i, record in enumerate(records):
                got = self._read(array, (record, *index), name)
                value[i] = got.reshape(shape)
                self.records_read += 1
                self.bytes_read += got.nbytes
                self.last_reads.append((name, record, index))
            out[name] = value
        return out

    def _read(self, array: Any, index: tuple, name: str) -> np.ndarray:
        try:
            return np.asarray(array[index])
        except (OSError, KeyError, RuntimeError) as e:  # a damaged chunk of the file
            raise ArrayDataError(
                f"{self.where}: reading record {index[0]} of dataset '{self.datasets[name]}' "
                f"({self.fields_key}.{name}) failed ({type(e).__name__}: {e}); the file may be "
                f"truncated or corrupt (left unchanged)") from None

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_store": None, "_index": None}
