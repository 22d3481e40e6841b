"""ERA5- and WeatherBench2-like files written by xarray (never by spmd), for the tests of
weather and climate data (issue 35) and for any later flagship that needs such files.

`write_era5_years(root, ...)` writes one NetCDF4 file per year, `era5_<year>.nc`, the way
ERA5 downloads look: dims (time, latitude, longitude), latitude north to south, variables
with CF attributes; `u10` is CF-packed int16 (scale_factor, add_offset, _FillValue), the
second year's file is zlib-compressed, `geopotential` has a `level` dimension (time, level,
latitude, longitude), `lsm` and `orography` are time-free constants. Variants: a gap of
`gap_days` days cut out of the timeline, one file with latitude reversed (south to north),
`sst` with NaN over land, one NaN planted in a variable at one time step. `legacy_cds=True`
writes the files as the Climate Data Store did before 2024: NetCDF3 64-bit offset, `time`
unlimited (int32 hours since 1900), every variable packed into int16 with its own
scale_factor / add_offset and _FillValue = missing_value = -32767.

`write_wb2_zarr(path, ...)` writes one Zarr v3 store of all the years, WeatherBench2's way:
dims (time, [level,] longitude, latitude), latitude south to north.

The values are a smooth pure function of (variable, level, time, latitude, longitude), so a
test can recompute any element. Grids are tiny (6 x 12) and the step daily, so three years
are about 2 MB.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

SURFACE = ("t2m", "u10", "v10", "msl")
LEVELS = (250, 500, 850)
PACKED = {"dtype": "int16", "scale_factor": 0.002, "add_offset": 0.0, "_FillValue": -32767}
TIME_UNITS = {"units": "hours since 1900-01-01 00:00:00", "calendar": "gregorian",
              "dtype": "int64"}


def grid(nlat: int = 6, nlon: int = 12) -> tuple[np.ndarray, np.ndarray]:
    """(latitude north to south, longitude) cell centres of a regular global grid."""
    dlat = 180.0 / nlat
    lat = 90.0 - dlat / 2 - dlat * np.arange(nlat)
    lon = np.arange(nlon) * (360.0 / nlon)
    return lat, lon


def times(years: tuple[int, ...], step_hours: int = 24) -> np.ndarray:
    """Every time of the years, datetime64[ns], `step_hours` apart."""
    start = np.datetime64(f"{years[0]}-01-01T00", "ns")
    stop = np.datetime64(f"{years[-1] + 1}-01-01T00", "ns")
    return np.arange(start, stop, np.timedelta64(step_hours, "h"))


def land(lat: np.ndarray, lon: np.ndarray) -> np.ndarray:
    """A fixed land mask (lat, lon) bool: a block of the grid."""
    mask = np.zeros((len(lat), len(lon)), bool)
    mask[1:3, 2:6] = True
    return mask


def values(name: str, t: np.ndarray, lat: np.ndarray, lon: np.ndarray,
           level: float | None = None) -> np.ndarray:
    """float32 (time, lat, lon) of variable `name` (at `level`): smooth in all coordinates."""
    days = (t - np.datetime64("2000-01-01", "ns")) / np.timedelta64(1, "D")
    k = sum(map(ord, name)) % 7 + (0 if level is None else level / 100.0)
    la, lo = np.deg2rad(lat)[None, :, None], np.deg2rad(lon)[None, None, :]
    d = np.asarray(days, float)[:, None, None]
    base = {"t2m": 280.0, "u10": 0.0, "v10": 0.0, "msl": 101000.0, "sst": 290.0,
            "geopotential": 9.81 * (level or 0) * 10.0}.get(name, 0.0)
    amp = {"msl": 500.0, "geopotential": 300.0, "t2m": 15.0, "sst": 5.0}.get(name, 8.0)
    wave = (np.sin(2 * np.pi * d / 365.25 + k) * np.cos(la) + 0.4 * np.sin(la + k)
            + 0.3 * np.sin(lo * 2 + 0.1 * d + k))         # not symmetric in latitude
    return (base + amp * wave).astype(np.float32)


def dataset(t: np.ndarray, lat: np.ndarray, lon: np.ndarray, *, sst: bool = False,
            nan_at: tuple[str, int] | None = None, constants: bool = True) -> object:
    """An xarray Dataset of the ERA5-like variables at times `t` (NetCDF dim order)."""
    import xarray as xr

    dims = ("time", "latitude", "longitude")
    data = {name: (dims, values(name, t, lat, lon)) for name in SURFACE}
    data["geopotential"] = (("time", "level", "latitude", "longitude"),
                            np.stack([values("geopotential", t, lat, lon, lv)
                                      for lv in LEVELS], axis=1))
    if sst:
        v = values("sst", t, lat, lon)
        v[:, land(lat, lon)] = np.nan
        data["sst"] = (dims, v)
    if constants:
        data["lsm"] = (("latitude", "longitude"), land(lat, lon).astype(np.float32))
        data["orography"] = (("latitude", "longitude"),
                             (1000.0 * land(lat, lon) + lat[:, None] + 0 * lon).astype(
                                 np.float32))
    if nan_at is not None:
        name, i = nan_at
        data[name][1][i, 0, 0] = np.nan
    ds = xr.Dataset(data, coords={"time": t, "level": np.array(LEVELS, np.int32),
                                  "latitude": lat, "longitude": lon})
    ds["t2m"].attrs.update(units="K", long_name="2 metre temperature")
    ds["u10"].attrs.update(units="m s**-1", long_name="10 metre U wind component")
    ds["latitude"].attrs.update(units="degrees_north", standard_name="latitude")
    ds["longitude"].attrs.update(units="degrees_east", standard_name="longitude")
    return ds


def write_era5_years(root: Path, years: tuple[int, ...] = (2000, 2001, 2002), *,
                     nlat: int = 6, nlon: int = 12, step_hours: int = 24,
                     zlib_year: int | None = 2001, gap_days: int = 0,
                     gap_year: int | None = None, reversed_lat_year: int | None = None,
                     sst: bool = False, nan_at: tuple[str, int, int] | None = None,
                     legacy_cds: bool = False) -> list[Path]:
    """One NetCDF4 file (NetCDF3 with `legacy_cds`) per year in `root` (era5_<year>.nc);
    the paths, in time order.

    `gap_days` days are cut from the middle of `gap_year` (a gap in the time axis);
    `reversed_lat_year`'s file runs south to north; `sst` adds sea-surface temperature with
    NaN over land; `nan_at=(variable, year, time index)` plants one NaN at that step.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    lat, lon = grid(nlat, nlon)
    paths = []
    for year in years:
        t = times((year,), step_hours)
        if gap_days and year == gap_year:
            mid = len(t) // 2
            cut = gap_days * 24 // step_hours
            t = np.concatenate([t[:mid], t[mid + cut:]])
        nan = (nan_at[0], nan_at[2]) if nan_at and nan_at[1] == year else None
        ds = dataset(t, lat, lon, sst=sst, nan_at=nan)
        if year == reversed_lat_year:
            ds = ds.isel(latitude=slice(None, None, -1))
        encoding = {"time": dict(TIME_UNITS), "u10": dict(PACKED)}
        if year == zlib_year:
            for name in ds.data_vars:
                encoding.setdefault(name, {}).update(zlib=True, complevel=4)
        path = root / f"era5_{year}.nc"
        if legacy_cds:
            ds.to_netcdf(path, encoding=cds_packing(ds), engine="netcdf4",
                         format="NETCDF3_64BIT", unlimited_dims=["time"])
            paths.append(path)
            continue
        ds.to_netcdf(path, encoding=encoding, engine="netcdf4", format="NETCDF4")
        paths.append(path)
    return paths


def cds_packing(ds) -> dict:
    """The legacy CDS encoding: each variable packed into int16 over its own range
    (add_offset = the middle, the extremes at -32766 and 32766), fill -32767."""
    encoding: dict = {"time": {"units": TIME_UNITS["units"], "calendar": "gregorian",
                               "dtype": "int32"}}
    for name, var in ds.data_vars.items():
        lo, hi = float(np.nanmin(var.values)), float(np.nanmax(var.values))
        scale = (hi - lo) / (2 ** 16 - 4) or 1.0
        encoding[name] = {"dtype": "int16", "scale_factor": scale, "add_offset": (hi + lo) / 2,
                          "_FillValue": -32767, "missing_value": -32767}
    return encoding


def write_wb2_zarr(path: Path, years: tuple[int, ...] = (2000, 2001, 2002), *,
                   nlat: int = 6, nlon: int = 12, step_hours: int = 24,
                   time_chunk: int = 4) -> Path:
    """One Zarr v3 store of all `years`, WeatherBench2's layout: (time, [level,]
    longitude, latitude), latitude south to north, `u10` CF-packed int16, chunks of
    `time_chunk` steps."""
    lat, lon = grid(nlat, nlon)
    ds = dataset(times(years, step_hours), lat, lon)
    ds = ds.isel(latitude=slice(None, None, -1))
    ds = ds.transpose("time", "level", "longitude", "latitude")
    encoding = {"time": dict(TIME_UNITS), "u10": dict(PACKED)}
    for name, var in ds.data_vars.items():
        chunks = tuple(time_chunk if d == "time" else n for d, n in zip(var.dims, var.shape))
        encoding.setdefault(name, {})["chunks"] = chunks
    ds.to_zarr(path, encoding=encoding, zarr_format=3, consolidated=False, mode="w")
    return Path(path)
