"""NetCDF3 files (classic and 64-bit offset), read as they lie on disk.

Why: much of the ERA5 already on HPC file systems came from the Copernicus Climate Data
Store before 2024, whose NetCDF was NetCDF3 64-bit offset with int16 variables packed by
`scale_factor` / `add_offset` and an unlimited `time` dimension; so do many older
reanalysis and model outputs. These files are not HDF5 (h5py and h5netcdf cannot open
them), and converting a decade of files first (`nccopy -k nc4`) should not be the price
of reading them.

How: SciPy's NetCDF3 reader (`scipy.io.netcdf_file`, a dependency already) maps the file
(`mmap`) without decoding (`maskandscale=False`); CF decoding stays with xarray's rules
(`spmd.data.cf.cf_decode`), as for NetCDF4 and Zarr. A read returns native-endian values
(NetCDF3 stores big-endian), copied out of the map, so no array outlives the file. A
variable of the unlimited dimension is stored record by record, interleaved with the other
record variables; a block of time steps is one strided read of the map.

CDF5 (64-bit data, `CDF\\x05`) is not read by SciPy and is refused with the commands that
convert it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

MAGIC = {b"CDF\x01": "classic", b"CDF\x02": "64-bit offset", b"CDF\x05": "CDF5"}
CONVERT = ("convert it with `nccopy -k nc4 IN OUT` (netCDF-C) or "
           "`xarray.open_dataset(IN).to_netcdf(OUT)`")


def netcdf3_kind(path: Path) -> str | None:
    """'classic', '64-bit offset' or 'CDF5' for a NetCDF3 file (by its first 4 bytes), else
    None (HDF5 / NetCDF4, or not a file)."""
    try:
        with open(path, "rb") as f:
            return MAGIC.get(f.read(4))
    except OSError:
        return None


def unreadable_netcdf3(path: Path) -> str | None:
    """Why spmd cannot read NetCDF3 file `path`, with the commands that convert it (CDF5),
    else None."""
    if netcdf3_kind(path) != "CDF5":
        return None
    return (f"a NetCDF3 CDF5 (64-bit data) file, which spmd does not read; {CONVERT} (the "
            f"file was left unchanged)")


class NetCDF3Variable:
    """One variable of an open NetCDF3 file: `shape`, `ndim`, `dtype` (native-endian),
    `attrs`, `dimensions`, `chunks` (None: NetCDF3 is not chunked), and slicing that returns
    a native-endian copy of the values as stored."""

    chunks = None

    def __init__(self, var: Any):
        self._var = var
        self.shape = tuple(var.shape)
        self.ndim = len(self.shape)
        self.dtype = np.dtype(var.data.dtype).newbyteorder("=")
        self.attrs = {k: (v.decode() if isinstance(v, bytes) else v)
                      for k, v in var._attributes.items()}
        self.dimensions = tuple(var.dimensions)

    def __getitem__(self, index: Any) -> np.ndarray:
        if self._var is None:
            raise ValueError("the NetCDF3 file of this variable is closed")
        return np.array(self._var.data[index], dtype=self.dtype)

    def __len__(self) -> int:
        return self.shape[0]


class NetCDF3File:
    """An open NetCDF3 file: `variables` (name -> NetCDF3Variable) and `close()`."""

    def __init__(self, path: Path):
        from scipy.io import netcdf_file

        self._file: Any = None
        self.variables: dict[str, NetCDF3Variable] = {}
        self._file = netcdf_file(str(path), "r", mmap=True, maskandscale=False)
        self.variables = {str(name): NetCDF3Variable(v)
                          for name, v in self._file.variables.items()}

    def close(self) -> None:
        """Unmap the file: the variables' views of the map are dropped first (a variable
        read after this raises), so SciPy can close it cleanly."""
        if self._file is None:
            return
        for var in self.variables.values():
            var._var = None
        self.variables = {}
        self._file.close()
        self._file = None

    def __del__(self) -> None:     # an unclosed file: drop the views before SciPy's own close
        self.close()
