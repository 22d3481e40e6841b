"""`spmd predict` of a gridded run into a NetCDF4 forecast file that xarray opens with its
coordinates (`--output NAME.nc`, or `--format netcdf`).

Layout, after WeatherBench2's forecasts: one variable per channel, named as the channel
(`t2m`, `geopotential_500`), in physical units with the data's `units`, dims
`(time, lead, latitude, longitude)`:

    time                  each forecast's initial time (its last input frame), in the
                          data's CF calendar ("hours since 1970-01-01", `calendar`)
    lead                  1 .. rollout: model steps after `time`
    prediction_timedelta  (lead) the lead as a duration (fixed steps only: not for
                          monthly or yearly data, whose steps are calendar months / years)
    valid_time            (time, lead) the time a frame forecasts (fixed steps only)
    latitude, longitude   the frames' grid, in the frame's row order

Written with h5netcdf slab by slab (a forecast of many times never sits in memory whole),
under a temporary name renamed into place by `commit` (spmd.inference.outputs' contract:
an error leaves nothing behind and whatever was at the path untouched).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from spmd.data.sources.forecast_grid import TIME_UNITS, ForecastGrid
from spmd.errors import SpmdError
from spmd.inference.output_files import OneFileOutput

__all__ = ["NetcdfOutput"]


class NetcdfOutput(OneFileOutput):
    """A NetCDF4 forecast file (module docstring) of `shape` (records, [steps,] lat, lon,
    channels): `steps` is absent for rollout 1 (spmd.inference.prediction's layout)."""

    def __init__(self, path: Path, shape: tuple[int, ...], dtype: np.dtype,
                 grid: ForecastGrid):
        import h5netcdf

        super().__init__(path)

        if self.path.is_dir():
            raise SpmdError(f"--output {self.path} is a directory; a NetCDF forecast is one "
                            f"file")
        records, *rest = shape
        steps = rest[0] if len(rest) == 4 else 1
        nlat, nlon, channels = rest[-3:]
        if (nlat, nlon, channels) != (len(grid.lat), len(grid.lon), len(grid.channels)):
            raise SpmdError(f"--output {self.path}: predictions of shape {shape} do not fit "
                            f"the grid {len(grid.lat)} x {len(grid.lon)} of "
                            f"{len(grid.channels)} channels ({grid.channels})")
        self.rollout = len(rest) == 4
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._file = h5netcdf.File(self.tmp, "w")
        except OSError as e:
            raise SpmdError(f"--output {self.path}: cannot write {self.tmp}: {e}") from e
        try:
            self._variables = self._define(grid, records, steps, nlat, nlon, dtype)
        except BaseException:
            self.close()
            raise

    def _define(self, grid: ForecastGrid, records: int, steps: int, nlat: int, nlon: int,
                dtype: np.dtype) -> list[Any]:
        f = self._file
        f.dimensions = {"time": records, "lead": steps, "latitude": nlat, "longitude": nlon}

        def variable(name: str, dims: tuple[str, ...], values: Any, kind: str,
                     **attrs: Any) -> None:
            v = f.create_variable(name, dims, kind)
            v[...] = values
            v.attrs.update(attrs)

        calendar = grid.calendar.name
        variable("time", ("time",), grid.hours(grid.init_times), "f8", units=TIME_UNITS,
                 calendar=calendar, standard_name="forecast_reference_time",
                 long_name="initial time (the last input frame)")
        leads = np.arange(1, steps + 1)
        variable("lead", ("lead",), leads, "i4", long_name=f"model steps of "
                 f"{grid.step_text()} after time")
        coordinates = []
        if grid.fixed_step:
            hours = leads * grid.step_hours()
            variable("prediction_timedelta", ("lead",), hours, "f8", units="hours",
                     dtype="timedelta64[ns]", standard_name="forecast_period")
            valid = grid.hours(grid.init_times)[:, None] + hours[None, :]
            variable("valid_time", ("time", "lead"), valid, "f8", units=TIME_UNITS,
                     calendar=calendar, standard_name="time")
            coordinates = ["prediction_timedelta", "valid_time"]
        variable("latitude", ("latitude",), grid.lat, "f8", units="degrees_north",
                 standard_name="latitude")
        variable("longitude", ("longitude",), grid.lon, "f8", units="degrees_east",
                 standard_name="longitude")
        out = []
        for name, units in zip(grid.channels, grid.units):
            v = f.create_variable(name, ("time", "lead", "latitude", "longitude"), dtype,
                                  chunks=(1, 1, nlat, nlon))
            v.attrs.update({"units": units, "long_name": f"forecast of {name}"} if units
                           else {"long_name": f"forecast of {name}"})
            if coordinates:
                v.attrs["coordinates"] = " ".join(coordinates)
            out.append(v)
        return out

    def write(self, start: int, step: int | None, values: np.ndarray) -> None:
        lead = 0 if step is None else step
        rows = slice(start, start + len(values))
        for c, variable in enumerate(self._variables):
            variable[rows, lead] = values[..., c]

    def commit(self, attrs: dict[str, Any]) -> None:
        self._file.attrs.update({k: v if isinstance(v, int | float) else str(v)
                                 for k, v in attrs.items()})
        self._file.attrs["Conventions"] = "CF-1.8"
        self._place()
