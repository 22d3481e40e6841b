"""Reading the channels of a gridded timeline's files: rows of one variable (and level) of
one file, as stored or decoded, and the constant fields (spmd.data.sources.gridded_windows reads
its blocks through this).

Invariants:
- `raw` returns rows [lo, hi) of a channel of timeline file k as (time, latitude,
  longitude), whatever the variable's dimension order in the file, latitude as stored, the
  values as stored (packed counts stay counts); `decoded` decodes them as xarray does
  (spmd.data.cf.cf_decode) and puts latitude in the timeline's order.
- NetCDF4 variables are read with h5py directly (a NetCDF4 variable of the root group is
  the HDF5 dataset of its name): the same raw values as h5netcdf, without its bookkeeping
  per access. Each file is opened once, each (file, variable) looked up once (h5py's
  lookup by name costs ~0.2 ms a call); other formats go through the store
  (`open_store(k)`, ArraySource's leased store of the file).
- A `scratch` read of a variable stored (time, latitude, longitude) goes straight into a
  buffer the calling thread keeps (`read_direct`: no new array, no page faults of fresh
  memory); it is valid until that thread's next scratch read.
- A read that fails (a damaged chunk, a truncated file) raises ArrayDataError naming the
  file, the variable and the time indices; the file is left as it is.
- Thread safe; `close` closes the h5py files (reads after it open them again).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import numpy as np

from spmd.data.cf.cf_decode import decode
from spmd.data.cf.channels import COORDINATE_CONSTANTS, Channel
from spmd.data.cf.gridded_timeline import Timeline, level_index
from spmd.data.formats.stores import ArrayDataError

__all__ = ["GriddedReader"]


class GriddedReader:
    """Reads of `timeline`'s files; `open_store(k)` leases timeline file k's store (a
    context manager whose value has `.get(variable, config_key)`); `where` starts every
    message (the config key and path)."""

    def __init__(self, timeline: Timeline, open_store: Callable[[int], AbstractContextManager],
                 where: str):
        self.timeline, self.open_store, self.where = timeline, open_store, where
        self._h5: dict[int, Any] = {}                      # timeline file -> h5py.File
        self._h5_nodes: dict[tuple[int, str], Any] = {}    # (file, variable) -> its dataset
        self._h5_lock = threading.Lock()
        self._scratch = threading.local()                  # per thread: dtype -> buffer

    def decoded(self, k: int, channel: Channel, lo: int, hi: int) -> np.ndarray:
        """Rows [lo, hi) of file k's `channel`, decoded (xarray's dtype), as (time,
        latitude, longitude) in the timeline's latitude order."""
        f = self.timeline.files[k]
        values = decode(self.raw(k, channel, lo, hi), f.variables[channel.variable].coding)
        return values[:, ::-1] if f.flip_lat else values

    def raw(self, k: int, channel: Channel, lo: int, hi: int,
            scratch: bool = False) -> np.ndarray:
        """Rows [lo, hi) of file k's `channel` as stored (not decoded), as (time, latitude,
        longitude), latitude as stored; `scratch`: into this thread's buffer (see above)."""
        f = self.timeline.files[k]
        var = f.variables[channel.variable]
        if scratch and var.dims == (f.dims["time"], f.dims["lat"], f.dims["lon"]):
            array = self._h5_array(k, channel.variable)
            if array is not None:
                return self._read_scratch(k, channel, array, lo, hi)
        index: list[Any] = []
        keep: list[str] = []
        for dim in var.dims:
            if dim == f.dims["time"]:
                index.append(slice(lo, hi))
                keep.append("time")
            elif dim == f.dims.get("level"):
                index.append(level_index(f, channel, self.where))
            else:
                index.append(slice(None))
                keep.append("lat" if dim == f.dims["lat"] else "lon")
        try:
            array = self._h5_array(k, channel.variable)
            if array is not None:
                raw = np.asarray(array[tuple(index)])
            else:
                with self.open_store(k) as store:
                    array = store.get(channel.variable, "data.variables")
                    raw = np.asarray(array[tuple(index)])
        except (OSError, KeyError, RuntimeError, ValueError) as e:  # a damaged chunk
            raise self._read_error(k, channel, lo, hi, e) from None
        order = [keep.index(d) for d in ("time", "lat", "lon")]
        return raw if order == [0, 1, 2] else np.transpose(raw, order)

    def constants(self, names: Sequence[str], standardize: bool) -> np.ndarray:
        """The constant fields `names` (data.constants: variables without time, or the
        coordinates `latitude` / `longitude`) of the first file, decoded, as float32 (lat,
        lon, K); with `standardize`, each one (c - its grid mean) / its grid std."""
        tl = self.timeline
        f = tl.files[0]
        out = []
        lat2, lon2 = np.meshgrid(tl.lat, tl.lon, indexing="ij")
        for name in names:
            if name in COORDINATE_CONSTANTS:
                out.append(lat2 if name == "latitude" else lon2)
                continue
            var = f.variables[name]
            with self.open_store(0) as store:
                raw = np.asarray(store.get(name, "data.constants")[...])
            if var.dims[0] != f.dims["lat"]:
                raw = raw.T
            values = decode(raw, var.coding)
            out.append(values[::-1] if f.flip_lat else values)
        const = np.stack(out, axis=-1).astype(np.float64)
        if np.isnan(const).any():
            c = int(np.flatnonzero(np.isnan(const).reshape(-1, len(out)).any(0))[0])
            raise ArrayDataError(f"{self.where}: file {f.path}: constant '{names[c]}' "
                                 f"(data.constants) holds NaN; a constant input must be "
                                 f"finite everywhere")
        if standardize:
            std = const.std(axis=(0, 1))
            const = (const - const.mean(axis=(0, 1))) / np.where(std > 0, std, 1.0)
        return const.astype(np.float32)

    def close(self) -> None:
        """Close the h5py files."""
        with self._h5_lock:
            self._h5_nodes.clear()
            for handle in self._h5.values():
                handle.close()
            self._h5.clear()

    def _h5_array(self, k: int, name: str) -> Any:
        """Variable `name` of NetCDF4 file k as an h5py dataset, or None (then read through
        the store)."""
        f = self.timeline.files[k]
        if f.format != "netcdf":
            return None
        with self._h5_lock:
            if (k, name) in self._h5_nodes:
                return self._h5_nodes[(k, name)]
            handle = self._h5.get(k)
            if handle is None:
                from spmd.data.formats.field_files import open_h5  # h5py: imported when read

                try:
                    handle = open_h5(f.path)   # without file locking where flock is refused
                except OSError:
                    return None                # the store's reader opens it, or names it
                self._h5[k] = handle
            node = handle.get(name)
            node = node if node is not None and hasattr(node, "shape") else None
            self._h5_nodes[(k, name)] = node
            return node

    def _read_scratch(self, k: int, channel: Channel, array: Any, lo: int,
                      hi: int) -> np.ndarray:
        shape = (hi - lo, *array.shape[1:])
        size, dtype = int(np.prod(shape)), np.dtype(array.dtype)
        buffers = self._scratch.__dict__.setdefault("buffers", {})
        if dtype not in buffers or buffers[dtype].size < size:
            buffers[dtype] = np.empty(size, dtype)
        out = buffers[dtype][:size].reshape(shape)
        try:
            array.read_direct(out, np.s_[lo:hi])
        except (OSError, KeyError, RuntimeError, ValueError, TypeError) as e:  # a damaged chunk
            raise self._read_error(k, channel, lo, hi, e) from None
        return out

    def _read_error(self, k: int, channel: Channel, lo: int, hi: int,
                    e: Exception) -> ArrayDataError:
        return ArrayDataError(
            f"{self.where}: file {self.timeline.files[k].path}: reading variable "
            f"'{channel.variable}' at time index {lo}..{hi - 1} failed ({type(e).__name__}: "
            f"{e}); the file may be truncated or corrupt (left unchanged)")
