"""Rewrite NetCDF4 files or a Zarr store with chunks of `time_chunk` x latitude x longitude
(`spmd data rechunk IN OUT`): the layout that GriddedWindowSource reads fast.

Why: a file whose time chunks are much longer than a read block (`spmd data info` warns,
naming the file and variable) makes every block decompress whole chunks for a part of them.
xarray reads and writes the data, so CF encodings (packing, fill values, time units) are
kept as they were; only the chunks (and zlib level of NetCDF4 variables) change.

Invariants: IN is never modified; OUT must not exist (a file, a directory of files or a
store, the same kind as IN); a directory IN gives a directory OUT with each NetCDF4 file
rewritten under the same name; variables without a time dimension keep one chunk.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from spmd.data.formats.stores import NETCDF_SUFFIXES, XARRAY_ENGINES, ArrayDataError, detect_format

__all__ = ["rechunk"]

TIME_NAMES = ("time", "valid_time")
DROP = ("chunksizes", "chunks", "contiguous", "preferred_chunks", "original_shape",
        "shuffle", "zlib", "complevel", "compression", "compressor", "compressors",
        "filters", "fletcher32", "source", "szip", "zstd", "bzip2", "blosc",
        "endian", "quantize_mode", "significant_digits", "serializer")


def _chunks(var: Any, time_chunk: int) -> tuple[int, ...]:
    return tuple(min(time_chunk, n) if d in TIME_NAMES else n
                 for d, n in zip(var.dims, var.shape))


def _encoding(ds: Any, time_chunk: int, zarr: bool, complevel: int) -> dict[str, dict]:
    out = {}
    for name, var in ds.variables.items():
        enc = {k: v for k, v in var.encoding.items() if k not in DROP}
        if name in ds.data_vars and var.ndim:
            if zarr:
                enc["chunks"] = _chunks(var, time_chunk)
            else:
                enc.update(chunksizes=_chunks(var, time_chunk), zlib=complevel > 0,
                           complevel=complevel)
        out[name] = enc
    return out


def _one(src: Path, dst: Path, time_chunk: int, complevel: int) -> None:
    import xarray as xr

    zarr = src.suffix == ".zarr" or (src / "zarr.json").exists()
    engine = "zarr" if zarr else XARRAY_ENGINES.get(detect_format(src), "h5netcdf")
    with xr.open_dataset(src, engine=engine, chunks=None) as ds:
        ds = ds.load()
    encoding = _encoding(ds, time_chunk, zarr, complevel)
    if zarr:
        ds.to_zarr(dst, encoding=encoding, zarr_format=3, consolidated=False, mode="w-")
    else:
        ds.to_netcdf(dst, encoding=encoding, engine="netcdf4", format="NETCDF4")


def rechunk(src: str | Path, dst: str | Path, *, time_chunk: int = 1,
            complevel: int = 4) -> list[Path]:
    """Rewrite `src` (a NetCDF4 or NetCDF3 file, a directory of them, or a Zarr store) as `dst` with
    chunks of `time_chunk` steps x every latitude x every longitude; the files written."""
    src, dst = Path(src), Path(dst)
    if time_chunk < 1:
        raise ArrayDataError(f"--time-chunk {time_chunk}: give at least 1")
    if not src.exists():
        raise ArrayDataError(f"{src}: no such file, directory or store")
    if dst.exists():
        raise ArrayDataError(f"{dst}: exists; give a new path (IN is never overwritten)")
    if src.is_dir() and src.suffix != ".zarr" and not (src / "zarr.json").exists():
        files = sorted(p for p in src.iterdir() if p.suffix.lower() in NETCDF_SUFFIXES)
        if not files:
            raise ArrayDataError(f"{src}: a directory without NetCDF4 files "
                                 f"({', '.join(NETCDF_SUFFIXES)})")
        dst.mkdir(parents=True)
        for p in files:
            _one(p, dst / p.name, time_chunk, complevel)
        return [dst / p.name for p in files]
    _one(src, dst, time_chunk, complevel)
    return [dst]
