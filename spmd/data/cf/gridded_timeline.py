"""The files of a gridded data set as one checked timeline (CF coordinates, by name).

Why: ERA5 comes as yearly (or monthly) files, WeatherBench2 as one Zarr store; a model
steps through time across them. Each file's metadata are read once with xarray (dims by
name, time decoded the CF way, the variables' packing in `spmd.data.cf.cf_decode`), then
checked together, so nothing is mixed in silently:

- times are read in any CF calendar (standard, proleptic_gregorian, noleap / 365_day,
  all_leap / 366_day, 360_day, julian; spmd.data.cf.calendars), one calendar per timeline;
- dimensions are found by name (time: `time`/`valid_time`; level: `level`,
  `pressure_level`, `plev`, `isobaricInhPa`; `latitude`/`lat`; `longitude`/`lon`), in
  whatever order the file stores them;
- the time coordinate increases within each file, and its step is regular within and
  across files: the common step is the most frequent difference; a difference that is not
  a whole number of steps, or files that overlap in time, are errors; a difference of
  several steps is a gap: refused (`data.time_gaps: error`, the default) or allowed
  (`allow`: the timeline is cut there and no window spans it);
- the files are put in time order; consecutive files continue one timeline segment;
- latitude and longitude agree across files: a file whose grid differs is refused by
  name; one whose latitude runs the other way is refused unless `data.latitude_order`
  (`north_to_south` / `south_to_north`) asks for a fixed order, then flipped on read;
- each variable exists in each file, holds time, latitude and longitude (and a level dim
  when levels are asked for), and each asked level exists.

Every error is one line naming the file, the variable and the coordinate value.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from spmd.data.cf.calendars import STANDARD as STANDARD_CALENDAR
from spmd.data.cf.calendars import Calendar, axis_times
from spmd.data.cf.cf_decode import Coding, coding_of
from spmd.data.cf.channels import COORDINATE_CONSTANTS, Channel
from spmd.data.formats.netcdf3 import unreadable_netcdf3
from spmd.data.formats.stores import ArrayDataError, detect_format, fingerprint, open_xarray

__all__ = ["FileAxes", "Timeline", "VarInfo", "build_timeline", "scan_file"]

log = logging.getLogger("spmd.data")

TIME_NAMES = ("time", "valid_time")
LEVEL_NAMES = ("level", "pressure_level", "plev", "isobaricInhPa", "lev")
LAT_NAMES = ("latitude", "lat")
LON_NAMES = ("longitude", "lon")
ROLES = {"time": TIME_NAMES, "level": LEVEL_NAMES, "lat": LAT_NAMES, "lon": LON_NAMES}
STANDARD = {"time": "time", "lat": "latitude", "lon": "longitude", "level": "air_pressure"}
LAT_ORDERS = ("as_stored", "north_to_south", "south_to_north")


@dataclass(frozen=True)
class VarInfo:
    """A variable of a file: its dims (file order), shape and CF coding."""

    dims: tuple[str, ...]
    shape: tuple[int, ...]
    coding: Coding
    units: str = ""


@dataclass
class FileAxes:
    """What one file holds along time, level, latitude and longitude, and its variables."""

    path: Path
    format: str
    dims: dict[str, str]                      # role (time, level, lat, lon) -> dim name
    times: np.ndarray                         # axis times, datetime64[us] (calendars)
    lat: np.ndarray
    lon: np.ndarray
    levels: np.ndarray | None
    variables: dict[str, VarInfo]
    flip_lat: bool = False                    # read latitude reversed (data.latitude_order)
    calendar: Calendar = STANDARD_CALENDAR    # the CF calendar of `times`


def _open(path: Path, fmt: str) -> Any:
    return open_xarray(path, fmt) if fmt == "zarr" else open_xarray(path, fmt, cache=False)


def _role_dims(ds: Any) -> dict[str, str]:
    """Role -> dim name, by name, else by the coordinate's standard_name / axis."""
    out: dict[str, str] = {}
    for dim in ds.dims:
        for role, names in ROLES.items():
            if dim in names and role not in out:
                out[role] = str(dim)
    for dim in ds.dims:
        if dim in out.values() or dim not in ds.coords:
            continue
        attrs = ds[dim].attrs
        for role, std in STANDARD.items():
            axis = {"time": "T", "level": "Z", "lat": "Y", "lon": "X"}[role]
            if role not in out and (attrs.get("standard_name") == std
                                    or attrs.get("axis") == axis):
                out[role] = str(dim)
    return out


_SCANS: dict[tuple[str, str], FileAxes] = {}     # (path, fingerprint) -> its axes


def scan_file(path: Path, where: str) -> FileAxes:
    """The axes and variables of one NetCDF4 / HDF5 file or Zarr store (through xarray),
    remembered per process while the file's size and mtime stay the same (a task's train
    and test sources scan each file once)."""
    path = Path(path)
    try:
        key = (str(path), json.dumps(fingerprint(path), sort_keys=True))
    except OSError:
        key = None
    if key is not None and key in _SCANS:
        return dataclasses.replace(_SCANS[key], flip_lat=False)
    axes = _scan(path, where)
    if key is not None:
        _SCANS[key] = axes
    return dataclasses.replace(axes)


def _scan(path: Path, where: str) -> FileAxes:
    if not Path(path).exists():
        raise ArrayDataError(f"{where}: file {path} does not exist (moved or deleted since "
                             f"it was indexed?)")
    fmt = detect_format(path)
    why = unreadable_netcdf3(path) if fmt == "netcdf3" else None
    if why is not None:
        raise ArrayDataError(f"{where}: file {path}: {why}")
    try:
        ds = _open(path, fmt)
    except Exception as e:  # xarray raises many types for a damaged or foreign file
        raise ArrayDataError(f"{where}: file {path}: xarray cannot open it "
                             f"({type(e).__name__}: {e}); it may be truncated or not "
                             f"NetCDF / Zarr") from None
    with ds:
        dims = _role_dims(ds)
        for role in ("time", "lat", "lon"):
            if role not in dims:
                raise ArrayDataError(f"{where}: file {path}: no {role} dimension (looked for "
                                     f"{list(ROLES[role])} or a coordinate with standard_name "
                                     f"'{STANDARD[role]}'); it has dims {list(ds.dims)}")

        def coord(role: str) -> np.ndarray | None:
            name = dims.get(role)
            if name is None:
                return None
            # a copy: a NetCDF3 file's values are views of its memory map, closed below
            return np.array(ds[name].values) if name in ds.coords else np.arange(
                ds.sizes[name])

        calendar, times = axis_times(coord("time"),
                                     f"{where}: file {path}: variable '{dims['time']}'")
        variables = {}
        for name, var in ds.data_vars.items():
            variables[str(name)] = VarInfo(tuple(map(str, var.dims)), tuple(var.shape),
                                           coding_of(var, f"{where}: file {path}", str(name)),
                                           str(var.attrs.get("units", "")))
        return FileAxes(path, fmt, dims, times, coord("lat"), coord("lon"), coord("level"),
                        variables, calendar=calendar)


@dataclass
class Timeline:
    """Files in time order as one timeline of `len(times)` positions, cut into segments
    where a gap is allowed. Position p is row `p - offsets[k]` of file k."""

    files: list[FileAxes]
    times: np.ndarray
    offsets: np.ndarray                        # cumulative rows, len(files) + 1
    step: np.timedelta64
    segments: list[tuple[int, int]]            # [lo, hi) positions without a gap
    gaps: list[tuple[str, str, str]] = field(default_factory=list)   # (file, before, after)

    @property
    def lat(self) -> np.ndarray:
        f = self.files[0]
        return f.lat[::-1] if f.flip_lat else f.lat

    @property
    def lon(self) -> np.ndarray:
        return self.files[0].lon

    def window_starts(self, span: int, stride: int, start: np.datetime64 | None = None,
                      end: np.datetime64 | None = None) -> np.ndarray:
        """Positions t0 of every window of `span` steps inside one segment whose times all
        lie in [start, end], t0 every `stride` steps from the segment's (or the range's)
        first position."""
        lo_all = 0 if start is None else int(np.searchsorted(self.times, start, "left"))
        hi_all = len(self.times) if end is None else int(
            np.searchsorted(self.times, end, "right"))
        out = []
        for lo, hi in self.segments:
            lo, hi = max(lo, lo_all), min(hi, hi_all)
            if hi - lo >= span:
                out.append(np.arange(lo, hi - span + 1, stride, dtype=np.int64))
        return np.concatenate(out) if out else np.zeros(0, np.int64)

    def pieces(self, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """Positions [lo, hi) as (file, first row, stop row) pieces, in time order."""
        out = []
        k = int(np.searchsorted(self.offsets, lo, "right")) - 1
        while lo < hi:
            stop = min(hi, int(self.offsets[k + 1]))
            out.append((k, lo - int(self.offsets[k]), stop - int(self.offsets[k])))
            lo, k = stop, k + 1
        return out

    @property
    def calendar(self) -> Calendar:
        """The CF calendar of every file (build_timeline refuses a mix)."""
        return self.files[0].calendar

    def text(self, t: np.datetime64) -> str:
        """Axis time `t` as a date of the data's calendar, to the minute."""
        return self.calendar.text(t)

    def describe(self) -> str:
        cal = "" if self.calendar == STANDARD_CALENDAR else f" ({self.calendar} calendar)"
        text = (f"{len(self.files)} file(s), {len(self.times)} times "
                f"{self.text(self.times[0])} .. {self.text(self.times[-1])}{cal} every "
                f"{step_text(self.step)}, "
                f"grid {len(self.lat)} x {len(self.lon)} (latitude {self.lat[0]:g} .. "
                f"{self.lat[-1]:g})")
        if self.gaps:
            text += f", {len(self.gaps)} gap(s): " + "; ".join(
                f"{b} -> {a} ({Path(f).name})" for f, b, a in self.gaps[:4])
        return text


CALENDAR_UNITS = {"M": "month", "Y": "year"}       # steps counted in the calendar's units
YEAR_MONTHS = {"M": 12, "Y": 1}


def step_text(step: np.timedelta64) -> str:
    """'6 h', '1 month', '1 year'."""
    unit = np.datetime_data(step.dtype)[0]
    if unit in CALENDAR_UNITS:
        return f"{int(step.astype(int))} {CALENDAR_UNITS[unit]}"
    return f"{step / np.timedelta64(1, 'h'):g} h"


def step_hours(step: np.timedelta64, calendar: Calendar = STANDARD_CALENDAR) -> float:
    """Hours of one step (a calendar month or year: its mean length in `calendar`)."""
    unit = np.datetime_data(step.dtype)[0]
    if unit in CALENDAR_UNITS:
        return calendar.year_days * 24 / YEAR_MONTHS[unit] * int(step.astype(int))
    return float(step / np.timedelta64(1, "h"))


def _in_units(times: np.ndarray, step: np.timedelta64, calendar: Calendar) -> np.ndarray:
    """`times` in the step's units: calendar months or years, else as they are."""
    unit = np.datetime_data(step.dtype)[0]
    return calendar.in_units(times, unit) if unit in CALENDAR_UNITS else times


def _calendar_step(diffs: np.ndarray, times: list[np.ndarray],
                   calendar: Calendar) -> np.timedelta64 | None:
    """One calendar month or year, where the data are monthly or yearly: steps of 28 days or
    more whose most common length in calendar months (or years) is 1, as pandas'
    `infer_freq` sees MS / M / YS series (a month's mean stamped on its first, middle or
    last day alike). None otherwise."""
    if np.median(diffs) < np.timedelta64(28, "D"):
        return None
    for unit in ("M", "Y"):
        stepped = np.diff(calendar.in_units(np.concatenate(times), unit))
        stepped = stepped[stepped > np.timedelta64(0, unit)]
        if len(stepped):
            values, counts = np.unique(stepped, return_counts=True)
            if values[int(np.argmax(counts))] == np.timedelta64(1, unit):
                return np.timedelta64(1, unit)
    return None


def _common_step(files: list[FileAxes], where: str) -> np.timedelta64:
    diffs = np.concatenate([np.diff(f.times) for f in files] +
                           [np.array([b.times[0] - a.times[-1]]) for a, b in
                            zip(files, files[1:])])
    diffs = diffs[diffs > np.timedelta64(0, "us")]
    if not len(diffs):
        raise ArrayDataError(f"{where}: every file holds a single time; the time step is "
                             f"unknown (variable 'time' of {files[0].path})")
    calendar = _calendar_step(diffs, [f.times for f in files], files[0].calendar)
    if calendar is not None:
        return calendar
    values, counts = np.unique(diffs, return_counts=True)
    return values[int(np.argmax(counts))]


def _check_times(files: list[FileAxes], step: np.timedelta64, gaps_key: str, gaps: str,
                 where: str) -> tuple[list[tuple[int, int]], list[tuple[str, str, str]]]:
    """Monotonic, regular times (in calendar months or years for monthly or yearly data);
    the segments between allowed gaps."""
    cuts, found = [], []
    offset = 0
    zero = np.timedelta64(0, np.datetime_data(step.dtype)[0])
    calendar = files[0].calendar
    text = calendar.text
    for k, f in enumerate(files):
        t = f.times
        name = f.dims["time"]
        bad = np.flatnonzero(np.diff(t) <= np.timedelta64(0, "us"))
        if len(bad):
            i = int(bad[0]) + 1
            raise ArrayDataError(f"{where}: file {f.path}: variable '{name}' does not increase: "
                                 f"{name}[{i}]={text(t[i])} follows "
                                 f"{text(t[i - 1])}; sort or deduplicate the file")
        tu = _in_units(t, step, calendar)
        d = np.diff(tu)
        same = np.flatnonzero(d <= zero)
        if len(same):
            i = int(same[0]) + 1
            raise ArrayDataError(f"{where}: file {f.path}: variable '{name}' holds two times "
                                 f"in one {step_text(step).split()[-1]}: {name}[{i}]="
                                 f"{text(t[i])} and {text(t[i - 1])}")
        prev = None if k == 0 else files[k - 1]
        jumps = [(int(i) + 1, t[i], t[i + 1]) for i in np.flatnonzero(d != step)]
        if prev is not None:
            gap = tu[0] - _in_units(prev.times[-1:], step, calendar)[0]
            if t[0] - prev.times[-1] <= np.timedelta64(0, "us") or gap <= zero:
                raise ArrayDataError(
                    f"{where}: file {f.path}: variable '{name}' starts at "
                    f"{text(t[0])}, not after the end {text(prev.times[-1])} of "
                    f"file {prev.path}: the files overlap in time; remove one of them")
            if gap != step:
                jumps.insert(0, (0, prev.times[-1], t[0]))
        for i, before, after in jumps:
            apart = (_in_units(np.array([after]), step, calendar)[0]
                     - _in_units(np.array([before]), step, calendar)[0])
            if apart % step:
                raise ArrayDataError(
                    f"{where}: file {f.path}: variable '{name}' steps irregularly at "
                    f"{name}[{i}]={text(after)} ({(after - before) / np.timedelta64(1, 'h'):g}"
                    f" h after {text(before)}; the data's step is {step_text(step)})")
            found.append((str(f.path), text(before), text(after)))
            if gaps != "allow":
                raise ArrayDataError(
                    f"{where}: file {f.path}: variable '{name}' has a gap at {name}[{i}]="
                    f"{text(after)} (previous time {text(before)}, step "
                    f"{step_text(step)}); set {gaps_key}: allow to train with windows that "
                    f"never span it")
            cuts.append(offset + i)
        offset += len(t)
    bounds = [0, *cuts, offset]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a], found


def _check_grid(files: list[FileAxes], lat_order: str, order_key: str, where: str) -> None:
    """Latitude / longitude of every file equal the first's (after the wanted flips)."""
    if lat_order not in LAT_ORDERS:
        raise ArrayDataError(f"{order_key}={lat_order}: one of {list(LAT_ORDERS)}")
    for f in files:
        if len(f.lat) > 1 and lat_order != "as_stored":
            north_first = f.lat[0] > f.lat[-1]
            f.flip_lat = north_first != (lat_order == "north_to_south")
    ref = files[0]
    ref_lat = ref.lat[::-1] if ref.flip_lat else ref.lat
    for f in files[1:]:
        lat = f.lat[::-1] if f.flip_lat else f.lat
        name = f.dims["lat"]
        if len(lat) != len(ref_lat) or len(f.lon) != len(ref.lon):
            raise ArrayDataError(
                f"{where}: file {f.path}: grid {len(lat)} x {len(f.lon)} ({name} x "
                f"{f.dims['lon']}) differs from {len(ref_lat)} x {len(ref.lon)} in file "
                f"{ref.path}; every file must hold the same grid")
        if not np.allclose(lat, ref_lat, rtol=0, atol=1e-6):
            if np.allclose(lat[::-1], ref_lat, rtol=0, atol=1e-6):
                runs = "south to north" if lat[0] < lat[-1] else "north to south"
                raise ArrayDataError(
                    f"{where}: file {f.path}: variable '{name}' runs {runs} ({lat[0]:g} .. "
                    f"{lat[-1]:g}) but file {ref.path} runs the other way ({ref_lat[0]:g} .. "
                    f"{ref_lat[-1]:g}); set {order_key}: north_to_south (or south_to_north) "
                    f"to flip files on read")
            i = int(np.flatnonzero(~np.isclose(lat, ref_lat, rtol=0, atol=1e-6))[0])
            raise ArrayDataError(f"{where}: file {f.path}: variable '{name}'[{i}]={lat[i]:g} "
                                 f"differs from {ref_lat[i]:g} in file {ref.path}; every file "
                                 f"must hold the same grid")
        if not np.allclose(f.lon, ref.lon, rtol=0, atol=1e-6):
            name = f.dims["lon"]
            i = int(np.flatnonzero(~np.isclose(f.lon, ref.lon, rtol=0, atol=1e-6))[0])
            raise ArrayDataError(f"{where}: file {f.path}: variable '{name}'[{i}]="
                                 f"{f.lon[i]:g} differs from {ref.lon[i]:g} in file {ref.path}; "
                                 f"every file must hold the same grid")


def level_index(f: FileAxes, channel: Channel, where: str) -> int:
    """The index of `channel.level` in file f's level coordinate (an error naming it)."""
    levels = f.levels
    if levels is None:
        raise ArrayDataError(f"{where}: file {f.path}: variable '{channel.variable}' has no "
                             f"level dimension, but data.variables asks for level "
                             f"{channel.level:g}; list it without levels")
    hit = np.flatnonzero(np.isclose(levels.astype(float), float(channel.level)))
    if not len(hit):
        have = [int(v) if float(v).is_integer() else float(v) for v in levels]
        raise ArrayDataError(f"{where}: file {f.path}: variable '{channel.variable}' has no "
                             f"{f.dims['level']}={channel.level:g}; the file has "
                             f"{have} (data.variables)")
    return int(hit[0])


def _check_variables(files: list[FileAxes], channels: list[Channel], constants: list[str],
                     where: str) -> None:
    for f in files:
        grid = {f.dims["lat"], f.dims["lon"]}
        for c in channels:
            var = f.variables.get(c.variable)
            if var is None:
                raise ArrayDataError(f"{where}: file {f.path}: variable '{c.variable}' "
                                     f"(data.variables) is missing; the file has "
                                     f"{sorted(f.variables)}")
            want = {f.dims["time"], *grid}
            if c.level is not None:
                level_index(f, c, where)
                want.add(f.dims["level"])
            if set(var.dims) != want:
                extra = sorted(set(var.dims) - want)
                hint = (f"; name its levels: {{{c.variable}: [...]}}" if f.dims.get("level")
                        in extra else "")
                raise ArrayDataError(f"{where}: file {f.path}: variable '{c.variable}' has dims "
                                     f"{list(var.dims)}, expected {sorted(want)} "
                                     f"(data.variables){hint}")
    first = files[0]
    for name in constants:
        if name in COORDINATE_CONSTANTS:
            continue
        var = first.variables.get(name)
        if var is None or set(var.dims) != {first.dims["lat"], first.dims["lon"]}:
            got = "is missing" if var is None else f"has dims {list(var.dims)}"
            raise ArrayDataError(f"{where}: file {first.path}: constant '{name}' "
                                 f"(data.constants) {got}; a constant is a variable of "
                                 f"latitude and longitude only, or latitude / longitude")


def build_timeline(paths: list[Path], channels: list[Channel], constants: list[str] = (),
                   *, where: str, time_gaps: str = "error",
                   latitude_order: str = "as_stored",
                   gaps_key: str = "data.time_gaps",
                   order_key: str = "data.latitude_order") -> Timeline:
    """Scan, order and check the files (module docstring); the timeline."""
    if time_gaps not in ("error", "allow"):
        raise ArrayDataError(f"{gaps_key}={time_gaps}: one of error, allow")
    files = [scan_file(p, where) for p in paths]
    calendars = {f.calendar for f in files}
    if len(calendars) > 1:
        by = {str(c): next(str(f.path) for f in files if f.calendar == c) for c in calendars}
        raise ArrayDataError(f"{where}: the files use different calendars: " + "; ".join(
            f"{c} (file {p})" for c, p in sorted(by.items())) + "; a timeline has one calendar")
    files.sort(key=lambda f: f.times[0] if len(f.times) else np.datetime64("NaT"))
    empty = [str(f.path) for f in files if not len(f.times)]
    if empty:
        raise ArrayDataError(f"{where}: file {empty[0]}: variable 'time' is empty (a file "
                             f"still being written?)")
    _check_grid(files, latitude_order, order_key, where)
    _check_variables(files, channels, list(constants), where)
    step = _common_step(files, where) if sum(len(f.times) for f in files) > 1 else \
        np.timedelta64(1, "h")
    segments, gaps = _check_times(files, step, gaps_key, time_gaps, where)
    times = np.concatenate([f.times for f in files])
    offsets = np.cumsum([0] + [len(f.times) for f in files])
    counts = collections.Counter(len(f.times) for f in files)
    log.debug("%s: timeline of %d files (%s rows)", where, len(files), dict(counts))
    for f, before, after in gaps:
        log.info("%s: file %s: a gap in time from %s to %s: no window spans it", where, f,
                 before, after)
    return Timeline(files, times, offsets, step, segments, gaps)
