"""The base of `spmd predict`'s outputs, and of those that are one file (HDF5, NetCDF).

Invariant (spmd.inference.outputs' contract): a one-file output is written under a
temporary name beside its path (`.NAME.tmpPID`) and renamed into place by `commit` only
when complete; `close` without `commit` deletes the temporary, so an error leaves no partial
output and whatever was at the path untouched.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["OneFileOutput", "Output"]


class Output:
    """An output that writes nothing (a process other than the writing one); its subclasses
    write. `write` puts `values` at examples [start, start + len) (and rollout step `step`,
    None for an output without steps); `commit` sets the attributes and puts the output in
    place; `close` after an error drops it."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.tmp = self.path.with_name(f".{self.path.name}.tmp{os.getpid()}")

    def write(self, start: int, step: int | None, values: np.ndarray) -> None:
        pass

    def commit(self, attrs: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass

    @staticmethod
    def _slab(start: int, step: int | None, rows: int) -> tuple[slice | int, ...]:
        return (slice(start, start + rows),) if step is None else \
            (slice(start, start + rows), step)


class OneFileOutput(Output):
    """An output that is one open file, `self._file` (h5py's or h5netcdf's), at `self.tmp`
    until `commit` renames it into place (`_place`)."""

    def __init__(self, path: Path):
        super().__init__(path)
        self._file: Any = None

    def _place(self) -> None:
        """Close the file and rename it into place; the temporary goes if that fails."""
        self._file.close()
        self._file = None
        try:
            os.replace(self.tmp, self.path)
        except BaseException:
            self.tmp.unlink(missing_ok=True)
            raise

    def close(self) -> None:
        if self._file is not None:  # not committed: an error on the way
            self._file.close()
            self._file = None
            self.tmp.unlink(missing_ok=True)
