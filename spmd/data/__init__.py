"""Data: deterministic sources and the feed that assembles global batches.

The public names for a user's task load lazily (no h5py/grain import until used):
`BatchField`, `DataSource`, and the on-disk array source `ArraySource` with its writer
`write_arrays` and its error `ArrayDataError`, `WindowSource` (time windows of stored
trajectories) and `GriddedWindowSource` (windows of weather / climate files read by variable
name), and `SourceSections`, what a source reads of a run's config (docs/data.md).

Here: the batch layout types (`batch`), the `data:` section (`data_config`: `DataConfig`,
`WindowConfig`, `SourceSections`), the record order of a split as a pure function of (seed,
step) (`order`) and reused batch buffers (`buffer_pool`). The rooms, each importing only
those below it:
- `formats`: stores and file formats (HDF5, NetCDF3/4, Zarr, .npy), direct reads of their
  bytes, many files as one dataset;
- `cf`: calendars, CF decoding, the timeline of gridded files, time splits, channels;
- `stats`: per-channel statistics and the fingerprint of a run's data;
- `reads`: how a source's records become batch rows;
- `sources`: the DataSources a task returns;
- `loader`: the global batch, background reads, the NaN probe.
May import `spmd.sharding` and `spmd.errors`; tasks import this layer, never the reverse.
"""

from __future__ import annotations

from spmd import lazy_exports

_PUBLIC = {
    "BatchField": "spmd.data.batch",
    "DataSource": "spmd.data.batch",
    "ArraySource": "spmd.data.sources.arrays",
    "ArrayDataError": "spmd.data.sources.arrays",
    "write_arrays": "spmd.data.sources.arrays",
    "WindowSource": "spmd.data.sources.windows",
    "GriddedWindowSource": "spmd.data.sources.gridded_windows",
    "SourceSections": "spmd.data.data_config",
}

__all__ = sorted(_PUBLIC)
__getattr__, __dir__ = lazy_exports(__name__, _PUBLIC)
