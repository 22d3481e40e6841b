"""Batches of field samples from an HDF5 fields file, as pure functions of (seed, step, row).

Built on grain's MapDataset: the train split is shuffled epoch by epoch with grain's
index shuffle (seed + epoch per epoch) and repeated forever, so global row `r` of step
`s` is position `s * batch_size + r` of that stream. A process reads only the rows it
owns, the answer does not depend on the process count, and the loader's position is
just the step, which the train state already carries: a resumed run reads exactly
the batch it would have read had it never stopped.
"""

from __future__ import annotations

from pathlib import Path

import grain
import h5py
import numpy as np

from spmd.data.fields import open_h5


class Hdf5Records:
    """grain random-access source: record `i` of one split as {"a", "u"} with a channel axis.

    The file is opened lazily (once per process) and read one chunk (= one sample) per record.
    """

    def __init__(self, path: Path, split: str, count: int, fields: tuple[str, ...] = ("a", "u")):
        self.path, self.split, self.count, self.fields = Path(path), split, count, fields
        self._file: h5py.File | None = None

    def __len__(self) -> int:
        return self.count

    def _group(self) -> h5py.Group:
        if self._file is None:
            self._file = open_h5(self.path)
        return self._file[self.split]

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        group = self._group()
        out = {}
        for name in self.fields:
            value = np.asarray(group[name][int(index)], dtype=np.float32)
            out[name] = value[..., None] if value.ndim == 2 else value
        return out

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_file": None}


class FieldBatches:
    """The DataSource of spmd.tasks.base: rows [start, stop) of the global batch at `step`.

    `shuffle=True` (train): an endless epoch-wise shuffled stream. `shuffle=False` (test):
    the split in file order, wrapping around; eval batch `i` is positions i*B .. i*B+B-1.
    """

    def __init__(self, path: Path, split: str, count: int, batch_size: int, *, seed: int,
                 shuffle: bool):
        self.records = Hdf5Records(path, split, count)
        self.batch_size = batch_size
        index = grain.MapDataset.range(count)
        if shuffle:
            index = index.shuffle(seed=seed % 2**32)
        self.index = index.repeat()                    # position -> record index
        self.dataset = self.index.map(self.records.__getitem__)

    def positions(self, step: int, start: int, stop: int) -> range:
        base = step * self.batch_size
        return range(base + start, base + stop)

    def record_indices(self, step: int, start: int, stop: int) -> list[int]:
        """Which records of the split rows [start, stop) of `step` are (for tests and logs)."""
        return [int(self.index[p]) for p in self.positions(step, start, stop)]

    def rows(self, step: int, start: int, stop: int) -> dict[str, np.ndarray]:
        if not 0 <= start <= stop <= self.batch_size:
            raise ValueError(f"rows [{start}, {stop}) outside the batch of {self.batch_size}")
        items = [self.dataset[p] for p in self.positions(step, start, stop)]
        return {k: np.stack([it[k] for it in items]) for k in self.records.fields}
