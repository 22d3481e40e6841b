"""Data: deterministic sources and the feed that assembles global batches.

The public names for a user's task load lazily (no h5py/grain import until used):
`BatchField`, `DataSource`, and the on-disk array source `ArraySource` with its writer
`write_arrays` and its error `ArrayDataError` (spmd.data.arrays), and `WindowSource`,
time windows of stored trajectories (spmd.data.windows), and `GriddedWindowSource`,
windows of weather / climate files read by variable name (spmd.data.gridded_windows).
Stores and formats (HDF5, NetCDF4, Zarr, .npy) live in spmd.data.stores, many files as one
dataset in spmd.data.file_index, background reads in spmd.data.prefetch (docs/data.md).

Owns the batch layout types (`batch`: `BatchField`, `DataSource`), sources, the feed and
the `data:` section (`data_config`: `DataConfig`, `WindowConfig`, and `SourceSections`, what
a source reads of a run's config).
May import `spmd.sharding` and `spmd.errors`; tasks import this layer, never the reverse.
"""

from __future__ import annotations

from spmd import lazy_exports

_PUBLIC = {
    "BatchField": "spmd.data.batch",
    "DataSource": "spmd.data.batch",
    "ArraySource": "spmd.data.arrays",
    "ArrayDataError": "spmd.data.arrays",
    "write_arrays": "spmd.data.arrays",
    "WindowSource": "spmd.data.windows",
    "GriddedWindowSource": "spmd.data.gridded_windows",
    "SourceSections": "spmd.data.data_config",
}

__all__ = sorted(_PUBLIC)
__getattr__, __dir__ = lazy_exports(__name__, _PUBLIC)
