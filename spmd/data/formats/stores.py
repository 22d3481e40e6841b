"""Array stores on disk: one file or directory holding named arrays, examples first.

Formats (what `detect_format` sees on disk):
- `hdf5`: an HDF5 file (h5py); dataset paths are HDF5 paths (`train/u0`).
- `netcdf`: a NetCDF4 file (`.nc`, `.nc4`, `.cdf`, `.netcdf`), read through h5netcdf; a
  variable `u0` in group `train` is the dataset path `train/u0`.
- `netcdf3`: a NetCDF3 file, classic or 64-bit offset (by its first bytes, whatever its
  name; `data.source: netcdf` covers both), read through SciPy (`spmd.data.formats.netcdf3`); CDF5
  is refused with the commands that convert it.
- `zarr`: a Zarr store directory (`*.zarr`, or any directory with a `zarr.json`; v3, sharded
  arrays included, and v2); arrays at the dataset paths, nested in groups.
- `npy`: a directory of `<dataset path>.npy` files, memory-mapped.

HDF5, NetCDF4 and Zarr arrays are chunked: slicing one example's slab reads only the chunks
it touches. Every error names the file, the dataset path and the config key.

`OPENED` counts the stores opened by this process to read records (path -> opens): a
test-visible hook. A look at metadata only (`Store(..., for_records=False)`) is not counted.
"""

from __future__ import annotations

import collections
import json
import os
import threading
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from spmd.atomic_write import atomic_path
from spmd.data.formats.netcdf3 import NetCDF3File, netcdf3_kind, unreadable_netcdf3
from spmd.errors import SpmdError

FORMATS = ("hdf5", "netcdf", "zarr", "npy")     # written by write_arrays; read: + netcdf3
NETCDF_SUFFIXES = (".nc", ".nc4", ".cdf", ".netcdf")
HDF5_SUFFIXES = (".h5", ".hdf5", ".he5", ".hdf")
ZARR_SUFFIX = ".zarr"
ZARR_METADATA = ("zarr.json", ".zarray", ".zgroup", ".zattrs")

# the xarray backend that reads each format's CF metadata (spmd.data.cf.gridded_timeline,
# spmd.data.cf.cf_decode, spmd.data.formats.rechunk)
XARRAY_ENGINES = {"netcdf": "h5netcdf", "netcdf3": "scipy", "zarr": "zarr"}


def open_xarray(path: Any, fmt: str, **kwargs: Any) -> Any:
    """xarray's lazy dataset (`chunks=None`) of the store at `path` of format `fmt`, through
    its engine (`XARRAY_ENGINES`; NetCDF4's for a format not there); a Zarr store with or
    without consolidated metadata, xarray's warning about the latter silenced."""
    import xarray as xr

    if fmt == "zarr":
        kwargs.setdefault("consolidated", None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)   # zarr: no consolidated metadata
        return xr.open_dataset(path, engine=XARRAY_ENGINES.get(fmt, "h5netcdf"), chunks=None,
                               **kwargs)

OPENED: collections.Counter[str] = collections.Counter()


class ArrayDataError(SpmdError):
    """A dataset file, dataset path or shape that does not fit the task's batch fields."""


def detect_format(path: Path) -> str:
    """The store format of `path` by what is on disk (and its name)."""
    path = Path(path)
    if path.is_dir():
        if path.suffix == ZARR_SUFFIX or any((path / m).exists() for m in ZARR_METADATA):
            return "zarr"
        return "npy"
    if netcdf3_kind(path) is not None:
        return "netcdf3"
    return "netcdf" if path.suffix.lower() in NETCDF_SUFFIXES else "hdf5"


def is_member_name(path: Path) -> bool:
    """Whether a directory entry is a store of a multi-file dataset (by its name)."""
    suffix = path.suffix.lower()
    return suffix in HDF5_SUFFIXES + NETCDF_SUFFIXES or (suffix == ZARR_SUFFIX and path.is_dir())


def fingerprint(path: Path) -> dict[str, int]:
    """Size and modification time of a store: of the file, or (a directory store) summed
    over its metadata files (Zarr) or its .npy files, so that a rewritten array shows."""
    path = Path(path)
    if not path.is_dir():
        st = path.stat()
        return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
    size = mtime = files = 0
    zarr = detect_format(path) == "zarr"
    for root, _, names in os.walk(path):
        for name in names:
            if (name in ZARR_METADATA) if zarr else name.endswith(".npy"):
                st = os.stat(os.path.join(root, name))
                size, mtime, files = size + st.st_size, max(mtime, st.st_mtime_ns), files + 1
    return {"size": size, "mtime_ns": mtime, "files": files}


class Store:
    """An open store: `get(dataset, key)` returns an array-like (shape, dtype, slicing).

    `where` prefixes every error (e.g. "data.path=/d/*.h5: file /d/part1.h5"); `format`
    forces a format (None: detected); `for_records=False` opens it for its metadata only
    (not counted in OPENED).
    """

    def __init__(self, path: Path, where: str, format: str | None = None,
                 for_records: bool = True):
        self.path, self.where = Path(path), where
        if not self.path.exists():
            raise ArrayDataError(
                f"{where}: no such file or directory on this host (make it with `spmd data "
                f"make CONFIG`; with several nodes it must be on a file system every rank sees)"
            )
        self.format = format or detect_format(self.path)
        self._handle: Any = None
        self._arrays: dict[str, Any] = {}
        self._fd: int | None = None                   # for direct reads (HDF5, NetCDF4)
        self._layouts: dict[str, Any] = {}
        self._reads: dict[str, str] = {}              # dataset -> how its records are read
        self._dtypes: dict[str, np.dtype] = {}
        self._direct_lock = threading.Lock()
        if for_records:
            OPENED[str(self.path)] += 1
        if self.format in ("hdf5", "netcdf"):
            if self.path.is_dir() or not h5py.is_hdf5(self.path):
                kind = "NetCDF4" if self.format == "netcdf" else "HDF5"
                hint = (" (nor NetCDF3)" if self.format == "netcdf" else
                        " (nor a Zarr store or a directory of .npy files)")
                article = "an" if kind == "HDF5" else "a"
                raise ArrayDataError(f"{where}: not {article} {kind} file{hint}; the file was "
                                     f"left unchanged")
            self._handle = self._open_hdf5()
        elif self.format == "netcdf3":
            self._handle = self._open_netcdf3()
        elif self.format == "zarr":
            self._handle = open_zarr(self.path, where)
        elif self.format != "npy":
            raise ArrayDataError(f"{where}: unknown store format {self.format!r} (one of "
                                 f"{list(FORMATS)})")

    def _open_hdf5(self) -> Any:
        def opener(**kw: Any) -> Any:
            if self.format == "netcdf":
                import h5netcdf

                return h5netcdf.File(self.path, "r", phony_dims="access", **kw)
            return h5py.File(self.path, "r", **kw)

        kind = "NetCDF4" if self.format == "netcdf" else "HDF5"
        try:
            try:
                return opener()
            except OSError as e:   # file systems without flock (common on parallel ones)
                if "lock" not in str(e).lower():
                    raise
                return opener(locking=False)
        except (OSError, KeyError, RuntimeError, ValueError) as e:
            raise ArrayDataError(f"{self.where}: cannot open the {kind} file "
                                 f"({type(e).__name__}: {e}); it may be truncated or corrupt "
                                 f"(left unchanged)") from None

    def _open_netcdf3(self) -> NetCDF3File:
        why = unreadable_netcdf3(self.path)
        if why is not None:
            raise ArrayDataError(f"{self.where}: {why}")
        kind = netcdf3_kind(self.path)
        try:
            return NetCDF3File(self.path)
        except (OSError, ValueError, TypeError, IndexError) as e:   # SciPy's parse errors
            raise ArrayDataError(f"{self.where}: cannot open the NetCDF3 ({kind}) file "
                                 f"({type(e).__name__}: {e}); it may be truncated or corrupt "
                                 f"(left unchanged)") from None

    def get(self, dataset: str, key: str) -> Any:
        """The array at `dataset`, or an error naming file, dataset path and config key."""
        if dataset not in self._arrays:
            self._arrays[dataset] = self._find(dataset, key)
        return self._arrays[dataset]

    def dtype(self, dataset: str, key: str) -> np.dtype:
        """The stored dtype of `dataset` (remembered: h5py asks HDF5 on every access)."""
        if dataset not in self._dtypes:
            self._dtypes[dataset] = np.dtype(self.get(dataset, key).dtype)
        return self._dtypes[dataset]

    def direct(self, dataset: str, key: str) -> Any:
        """A reader of whole records straight from the files' bytes, found once per dataset:
        `spmd.data.formats.direct_reads.FileRecords` for an uncompressed HDF5 / NetCDF4 dataset,
        `spmd.data.formats.zarr_chunks.ChunkRecords` for a Zarr v3 array of one record per chunk;
        None otherwise (read through `get`). A FileRecords' records are read with
        `direct_reads.read_jobs` at its offsets; `ChunkRecords.read(rows, buffers)` returns
        the records it left and how many missed the page cache; `reader.advise(rows)` (both)
        tells the kernel they will be read soon."""
        if self.format not in ("hdf5", "netcdf", "zarr"):
            return None
        with self._direct_lock:
            if dataset not in self._layouts:
                array = self.get(dataset, key)
                if self.format == "zarr":
                    from spmd.data.formats.zarr_chunks import ChunkRecords

                    reader, why = ChunkRecords.find(array)
                    self._layouts[dataset] = reader
                    self._reads[dataset] = why if reader is not None else \
                        f"through zarr: {why}"
                else:
                    from spmd.data.formats.direct_reads import DirectLayout, FileRecords

                    if self._fd is None:
                        self._fd = os.open(self.path, os.O_RDONLY)
                    layout = DirectLayout.of(array, self._fd)
                    self._layouts[dataset] = None if layout is None else \
                        FileRecords(self._fd, layout)
                    if layout is None:
                        how = ("through h5py: compressed or filtered, or a layout without "
                               "fixed offsets")
                    else:
                        kind = ("contiguous" if layout.rows_per_chunk >= len(array)
                                else "uncompressed chunks")
                        how = f"direct file reads: {kind}, at fixed offsets"
                    self._reads[dataset] = how
            return self._layouts[dataset]

    def reads(self, dataset: str, key: str) -> str:
        """How the records of `dataset` are read, and why: "direct chunk reads: ...",
        "direct file reads: ...", or "through zarr: <why not directly>" (`spmd data info`)."""
        if self.format not in ("hdf5", "netcdf", "zarr"):
            return {"npy": "through a NumPy memory map",
                    "netcdf3": "through the NetCDF3 reader"}.get(self.format, self.format)
        self.direct(dataset, key)
        return self._reads[dataset]

    def _find(self, dataset: str, key: str) -> Any:
        if self.format == "npy":
            file = self.path / f"{dataset}.npy"
            if not file.is_file():
                raise ArrayDataError(f"{self.where}: dataset '{dataset}' ({key}) is missing: "
                                     f"no file {file}; the directory has {self.datasets()}")
            return np.load(file, mmap_mode="r")
        kind = {"hdf5": "HDF5 dataset", "netcdf": "NetCDF variable",
                "netcdf3": "NetCDF variable", "zarr": "Zarr array"}[self.format]
        try:
            node = self._lookup(dataset)
        except (OSError, KeyError, RuntimeError, ValueError) as e:  # a damaged header
            raise ArrayDataError(
                f"{self.where}: {kind} '{dataset}' ({key}) cannot be read "
                f"({type(e).__name__}: {e}); the file may be truncated or corrupt "
                f"(left unchanged)") from None
        if node is None:
            raise ArrayDataError(f"{self.where}: {kind} '{dataset}' ({key}) is missing; the "
                                 f"file has {self.datasets()}")
        return node

    def _lookup(self, dataset: str) -> Any:
        h = self._handle
        if self.format == "hdf5":
            node = h.get(dataset)
            return node if isinstance(node, h5py.Dataset) else None
        if self.format == "netcdf":
            import h5netcdf

            *groups, leaf = dataset.strip("/").split("/")
            for g in groups:
                if g not in h.groups:
                    return None
                h = h.groups[g]
            node = h.variables.get(leaf) if leaf in h.variables else None
            return node if isinstance(node, h5netcdf.Variable) else None
        if self.format == "netcdf3":           # no groups in NetCDF3
            return h.variables.get(dataset.strip("/"))
        import zarr

        try:
            node = h.get(dataset)
        except KeyError:
            return None
        return node if isinstance(node, zarr.Array) else None

    def datasets(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """Every array of the store: dataset path -> (shape, dtype)."""
        out: dict[str, tuple[tuple[int, ...], str]] = {}
        if self.format == "npy":
            for p in sorted(self.path.rglob("*.npy")):
                a = np.load(p, mmap_mode="r")
                out[str(p.relative_to(self.path))[:-4]] = (tuple(a.shape), str(a.dtype))
        elif self.format == "hdf5":
            def visit(name: str, obj: Any) -> None:
                if isinstance(obj, h5py.Dataset):
                    out[name] = (tuple(obj.shape), str(obj.dtype))

            self._handle.visititems(visit)
        elif self.format == "netcdf":
            def walk(group: Any, prefix: str) -> None:
                for name, var in group.variables.items():
                    out[prefix + name] = (tuple(var.shape), str(var.dtype))
                for name, sub in group.groups.items():
                    walk(sub, f"{prefix}{name}/")

            walk(self._handle, "")
        elif self.format == "netcdf3":
            for name, var in self._handle.variables.items():
                out[name] = (var.shape, str(var.dtype))
        else:
            import zarr

            for name, node in self._handle.members(max_depth=None):
                if isinstance(node, zarr.Array):
                    out[name] = (tuple(node.shape), str(node.dtype))
        return dict(sorted(out.items()))

    def close(self) -> None:
        self._arrays.clear()
        self._layouts.clear()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._handle is not None and self.format in ("hdf5", "netcdf", "netcdf3"):
            self._handle.close()
        self._handle = None


def open_zarr(path: Path, where: str) -> Any:
    """The root group of a Zarr store, read-only (tests may wrap this to count reads)."""
    import zarr

    try:
        return zarr.open_group(str(path), mode="r")
    except Exception as e:  # zarr raises several types for a damaged or foreign store
        raise ArrayDataError(f"{where}: cannot open the Zarr store ({type(e).__name__}: "
                             f"{e}); it may be incomplete or not a Zarr store") from None


# ---------------------------------------------------------------- writing


def write_arrays(path: Path, arrays: Mapping[str, np.ndarray],
                 attrs: Mapping[str, Any] | None = None, *, format: str = "hdf5",
                 chunks: Mapping[str, tuple[int, ...]] | None = None,
                 shards: Mapping[str, tuple[int, ...]] | None = None) -> Path:
    """Write `{dataset path: array}` as one store, atomically (a temporary name in the same
    directory, renamed when complete): `hdf5` (default), `netcdf` (NetCDF4 through h5netcdf:
    groups and variables, one dimension per axis), `zarr` (v3; `shards` gives sharded
    arrays) or `npy` (a directory of .npy files, without attrs). Chunked formats take one
    example per chunk unless `chunks` says."""
    path = Path(path)
    if any(c in str(path) for c in "*?["):
        raise ArrayDataError(f"{path}: a glob names many files; a store is written to one "
                             f"file or directory (give data.path a plain path to make data)")
    if format not in FORMATS:
        raise ValueError(f"write_arrays: format {format!r} is not one of {list(FORMATS)}")
    path.parent.mkdir(parents=True, exist_ok=True)

    def chunk_of(name: str, value: np.ndarray) -> tuple[int, ...]:
        return tuple((chunks or {}).get(name, (1, *value.shape[1:])))

    with atomic_path(path, durable=False) as tmp:   # a file or a directory
        if format == "npy":
            tmp.mkdir()
            for name, value in arrays.items():
                (tmp / name).parent.mkdir(parents=True, exist_ok=True)
                np.save(tmp / f"{name}.npy", np.ascontiguousarray(value))
        elif format == "hdf5":
            with h5py.File(tmp, "w") as f:
                f.attrs.update(dict(attrs or {}))
                for name, value in arrays.items():
                    f.create_dataset(name, data=value,   # HDF5 chunks need a non-empty array
                                     chunks=chunk_of(name, value) if value.size else None)
        elif format == "netcdf":
            import h5netcdf

            with h5netcdf.File(tmp, "w") as f:
                f.attrs.update(dict(attrs or {}))
                for name, value in arrays.items():
                    *groups, leaf = name.strip("/").split("/")
                    group = f
                    for g in groups:
                        group = group.groups[g] if g in group.groups else group.create_group(g)
                    dims = tuple(f"{leaf}_{i}" for i in range(value.ndim))
                    group.dimensions.update(dict(zip(dims, value.shape)))
                    group.create_variable(leaf, dims, value.dtype, data=value,
                                          chunks=chunk_of(name, value) if value.size else None)
        else:
            import zarr

            root = zarr.open_group(str(tmp), mode="w")
            root.attrs.update(json.loads(json.dumps(dict(attrs or {}), default=_plain)))
            for name, value in arrays.items():
                shard = (shards or {}).get(name)
                array = root.create_array(name, shape=value.shape, dtype=value.dtype,
                                          chunks=chunk_of(name, value),
                                          shards=tuple(shard) if shard else None)
                array[...] = value
    return path


def _plain(value: Any) -> Any:
    return value.item() if isinstance(value, np.generic) else str(value)
