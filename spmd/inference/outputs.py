"""Where `spmd predict` writes: one array, `prediction`, filled slab by slab, committed whole.

Formats (`output_format`): `hdf5`, an HDF5 file (h5py), `zarr`, a Zarr v3 store
directory, and, for a run that trained on gridded files, `netcdf`, a forecast file with its
coordinates (spmd.inference.forecast_netcdf); `--format` names one, else the path does (a
name ending in `.zarr`: Zarr; `.nc`, `.nc4`: NetCDF; anything else: HDF5). HDF5 and Zarr
hold the same layout: the array at dataset path `prediction`,
created with its full shape before the first write (examples first, one example per
chunk), its attributes on that array, examples where `write` puts them. Either reads back
as data (`spmd.data.formats.stores.Store`, `--input` of another `spmd predict`).

Invariants:
- Only the writing process (`enabled`: process 0) touches the file system; the others get
  an `Output` that writes nothing.
- The output is built under a temporary name in the same directory (`.NAME.tmpPID`) and
  renamed into place by `commit` only when complete; `close` without `commit` deletes the
  temporary. So an error on the way leaves no partial output, no temporary, and whatever
  was at the path before untouched.
- A previous output of the same format at the path is replaced (an HDF5 file by one
  rename; a Zarr store is moved aside, the new one renamed in, the old one then deleted).
  Anything else there (a directory where HDF5 goes; a file, or a directory that is not a
  Zarr store, where Zarr goes) is refused when the output is opened, before any prediction.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from spmd.data.formats.stores import ZARR_METADATA, ZARR_SUFFIX
from spmd.errors import SpmdError
from spmd.inference.forecast_netcdf import NetcdfOutput
from spmd.inference.output_files import OneFileOutput, Output

OUTPUT_DATASET = "prediction"
OUTPUT_FORMATS = ("hdf5", "zarr", "netcdf")
NETCDF_SUFFIXES = (".nc", ".nc4")


def output_format(path: Path, format: str | None = None) -> str:
    """`format` if given (one of OUTPUT_FORMATS), else `zarr` for a path ending in .zarr,
    `netcdf` for one ending in .nc or .nc4 and `hdf5` for any other."""
    if format is None:
        suffix = Path(path).suffix.lower()
        return ("zarr" if suffix == ZARR_SUFFIX else
                "netcdf" if suffix in NETCDF_SUFFIXES else "hdf5")
    if format not in OUTPUT_FORMATS:
        raise SpmdError(f"--format {format}: the output formats are "
                        f"{', '.join(OUTPUT_FORMATS)} (default: zarr for an --output ending "
                        f"in {ZARR_SUFFIX}, netcdf for .nc, else hdf5)")
    return format


def open_output(path: Path, format: str, shape: tuple[int, ...], dtype: np.dtype, *,
                enabled: bool, grid: Any = None) -> Output:
    """The `prediction` array of `shape` at `path` in `format`, under its temporary name
    until `commit` (nothing at all unless `enabled`). `netcdf` needs the predictions'
    coordinates, `grid` (a spmd.data.sources.forecast_grid.ForecastGrid: a gridded run)."""
    path = Path(path)
    kind = output_format(path, format)
    if kind == "netcdf" and grid is None:
        raise SpmdError(f"--output {path}: a NetCDF forecast needs the coordinates of a run "
                        f"that trained on gridded files (data.variables); write this task's "
                        f"predictions to HDF5 (--format hdf5) or Zarr (NAME.zarr)")
    if not enabled:
        return Output(path)
    if kind == "netcdf":
        return NetcdfOutput(path, shape, dtype, grid)
    return {"hdf5": Hdf5Output, "zarr": ZarrOutput}[kind](path, shape, dtype)


class Hdf5Output(OneFileOutput):
    """An HDF5 file holding the dataset `prediction`."""

    def __init__(self, path: Path, shape: tuple[int, ...], dtype: np.dtype):
        super().__init__(path)
        import h5py

        if self.path.is_dir():
            raise SpmdError(f"--output {self.path} is a directory; HDF5 output is one file "
                            f"(give a file path, or a path ending in {ZARR_SUFFIX} or "
                            f"--format zarr for a Zarr store)")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._file = h5py.File(self.tmp, "w")
        except OSError as e:
            raise SpmdError(f"--output {self.path}: cannot write {self.tmp}: {e}") from e
        self.data = self._file.create_dataset(OUTPUT_DATASET, shape=shape, dtype=dtype,
                                              chunks=(1, *shape[1:]))

    def write(self, start: int, step: int | None, values: np.ndarray) -> None:
        self.data[self._slab(start, step, len(values))] = values

    def commit(self, attrs: dict[str, Any]) -> None:
        self.data.attrs.update(attrs)
        self._place()


class ZarrOutput(Output):
    """A Zarr v3 store whose root group holds the array `prediction`."""

    def __init__(self, path: Path, shape: tuple[int, ...], dtype: np.dtype):
        super().__init__(path)
        import zarr

        if self.path.exists() and not _replaceable_zarr(self.path):
            raise SpmdError(f"--output {self.path} exists and is not a Zarr store; give a new "
                            f"path (a Zarr store there would be replaced), or --format hdf5 "
                            f"to write an HDF5 file")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._open = True
        try:
            root = zarr.open_group(str(self.tmp), mode="w", zarr_format=3)
            self.data = root.create_array(OUTPUT_DATASET, shape=shape, dtype=dtype,
                                          chunks=(1, *shape[1:]))
        except Exception as e:  # zarr raises several types (OSError, ValueError, ...)
            self.close()
            raise SpmdError(f"--output {self.path}: cannot write the Zarr store {self.tmp}: "
                            f"{type(e).__name__}: {e}") from e

    def write(self, start: int, step: int | None, values: np.ndarray) -> None:
        self.data[self._slab(start, step, len(values))] = values

    def commit(self, attrs: dict[str, Any]) -> None:
        self.data.attrs.update(attrs)
        old = self.path.with_name(f".{self.path.name}.old{os.getpid()}")
        aside = self.path.exists()
        if aside:   # a directory is not replaced by a rename: move the old store aside
            os.replace(self.path, old)
        try:
            os.replace(self.tmp, self.path)
        except BaseException:
            if aside:
                os.replace(old, self.path)
            raise           # close() deletes the temporary
        self._open = False
        shutil.rmtree(old, ignore_errors=True)

    def close(self) -> None:
        if self._open:  # not committed: an error on the way
            self._open = False
            shutil.rmtree(self.tmp, ignore_errors=True)


def _replaceable_zarr(path: Path) -> bool:
    """Whether `path` is a Zarr store (or an empty directory) that an output may replace."""
    return path.is_dir() and (any((path / m).is_file() for m in ZARR_METADATA)
                              or not any(path.iterdir()))
