"""CF calendars (issue 49, item 5): files of every CF calendar, written by xarray through
cftime as climate models write them, read on spmd's timeline; date splits in the file's own
calendar, each window count checked against xarray's `sel(time=slice(...))` on the same file.

- daily data of each calendar: no false gap at February's end, each time's text equal to
  xarray's own, the split's window count equal to xarray's slice;
- a date the calendar lacks (2001-02-29 of noleap) is refused naming the calendar; one it
  has (2001-02-30 of 360_day) is read;
- annual means of a 500-year 360_day control run (past numpy's nanosecond range) step in
  years; CMIP monthly ocean means on noleap with land as _FillValue step in months, and a
  missing month is a gap;
- files of two calendars are refused, naming both.
"""

from __future__ import annotations

import numpy as np
import pytest

from spmd.data.cf.calendars import Calendar, axis_times
from spmd.data.formats.stores import ArrayDataError
from tests.helpers.era5_files import grid, land
from tests.unit.data.sources.test_weather_data import source

xr = pytest.importorskip("xarray")
cftime = pytest.importorskip("cftime")

CALENDARS = ("noleap", "365_day", "360_day", "all_leap", "366_day", "julian", "standard",
             "proleptic_gregorian")


def write(path, times, *, name="t2m", units="days since 1850-01-01", calendar=None,
          land_fill=False, seed=0) -> None:
    """A (time, lat, lon) variable at cftime `times`, by xarray, time encoded in `units`
    of the times' calendar (land as _FillValue 1e20 with `land_fill`, as CMIP's ocean)."""
    lat, lon = grid()
    values = (280 + np.random.default_rng(seed).standard_normal(
        (len(times), len(lat), len(lon)))).astype(np.float32)
    encoding = {"time": {"units": units, "calendar": calendar or times[0].calendar}}
    if land_fill:
        values[:, land(lat, lon)] = np.nan
        encoding[name] = {"_FillValue": 1e20}
    ds = xr.Dataset({name: (("time", "lat", "lon"), values, {"units": "K"})},
                    coords={"time": ("time", times), "lat": lat, "lon": lon})
    ds.to_netcdf(path, encoding=encoding)


def dates(start: str, periods: int, freq: str, calendar: str) -> np.ndarray:
    return np.asarray(xr.date_range(start, periods=periods, freq=freq, calendar=calendar,
                                    use_cftime=True))


def xarray_count(path, end: str, span: int = 2) -> int:
    """Windows of `span` steps in `sel(time=slice(None, end))`, by xarray alone."""
    with xr.open_dataset(path, decode_times=xr.coders.CFDatetimeCoder(use_cftime=True)) as ds:
        return ds.sel(time=slice(None, end)).sizes["time"] - span + 1


@pytest.mark.parametrize("calendar", CALENDARS)
def test_daily_data_of_every_calendar_read_as_xarray_decodes_them(tmp_path, calendar):
    path = tmp_path / f"{calendar}.nc"
    write(path, dates("2000-01-01", 800, "D", calendar))
    src = source(path, ["t2m"], time_range=(None, None))
    tl = src.timeline
    assert len(tl.times) == 800 and tl.segments == [(0, 800)]     # no gap at any Feb end
    assert src.count == 799 and "every 24 h" in src.describe()
    with xr.open_dataset(path, decode_times=xr.coders.CFDatetimeCoder(use_cftime=True)) as ds:
        want = [t.strftime("%Y-%m-%dT%H:%M") for t in ds.time.values]
        frames = ds["t2m"].values
    assert [tl.text(t) for t in tl.times] == want
    np.testing.assert_array_equal(src.rows(0, 0, 1)["target"][0, ..., 0], frames[1])
    for end in ("2000-02-28", "2000-03", "2001"):                  # a day, a month, a year
        split = {"train": {"end": end}, "test": {"start": "2002-01-01"}}
        part = source(path, ["t2m"], splits=split, split="train")
        assert part.count == xarray_count(path, end), (calendar, end)
    if calendar not in ("standard", "proleptic_gregorian"):
        assert f"({tl.calendar.name} calendar)" in src.describe()


def test_a_date_is_read_in_the_files_calendar(tmp_path):
    noleap, days360 = tmp_path / "noleap.nc", tmp_path / "360.nc"
    write(noleap, dates("2001-01-01", 120, "D", "noleap"))
    write(days360, dates("2001-01-01", 120, "D", "360_day"))
    splits = {"train": {"end": "2001-02-29"}, "test": {"start": "2001-03-01"}}
    with pytest.raises(ArrayDataError) as e:
        source(noleap, ["t2m"], splits=splits, split="train").check()
    assert "data.splits.train.end='2001-02-29': not a date of the data's noleap calendar" \
        in str(e.value)
    splits = {"train": {"end": "2001-02-30"}, "test": {"start": "2001-03-01"}}
    src = source(days360, ["t2m"], splits=splits, split="train")
    assert src.count == xarray_count(days360, "2001-02-30") == 59
    assert src.covered_text() == "2001-01-01T00:00 .. 2001-02-30T00:00"
    test = source(days360, ["t2m"], splits=splits, split="test")
    assert test.count == 120 - 60 - 1


def test_annual_means_of_a_500_year_360_day_control_run_step_in_years(tmp_path):
    path = tmp_path / "tas_Amon_piControl.nc"
    # annual means stamped mid-year, 1850..2349: past datetime64[ns]'s end in 2262
    write(path, dates("1850-07-01", 500, "YS-JUL", "360_day"))
    src = source(path, ["t2m"], time_range=(None, None))
    assert src.count == 499 and "every 1 year" in src.describe()
    assert src.timeline.text(src.timeline.times[-1]) == "2349-07-01T00:00"
    splits = {"train": {"end": "2299"}, "test": {"start": "2300"}}
    test = source(path, ["t2m"], splits=splits, split="test")
    assert test.count == 50 - 1 and test.covered_text() == "2300-07-01T00:00 .. 2349-07-01T00:00"
    assert source(path, ["t2m"], splits=splits, split="train").count == \
        xarray_count(path, "2299")
    from spmd.data.cf.gridded_timeline import step_hours

    assert step_hours(src.timeline.step, src.timeline.calendar) == 360 * 24


def cmip_monthly(path, months: int, drop: int | None = None) -> None:
    """CMIP's Omon layout: noleap, each mean stamped at the middle of its month's bounds
    (days since 1850-01-01), land as _FillValue."""
    starts = dates("1990-01-01", months + 1, "MS", "noleap")
    middles = np.array([a + (b - a) / 2 for a, b in zip(starts[:-1], starts[1:])])
    if drop is not None:
        middles = np.delete(middles, drop)
    write(path, middles, name="tos", land_fill=True)


def test_cmip_monthly_means_on_noleap_with_land_step_in_months(tmp_path):
    path = tmp_path / "tos_Omon.nc"
    cmip_monthly(path, 36)
    src = source(path, ["tos"], nan="mask", mask=True, time_range=(None, None))
    assert src.count == 35 and "every 1 month" in src.describe()
    assert src.timeline.text(src.timeline.times[1]) == "1990-02-15T00:00"   # 28-day Feb
    with xr.open_dataset(path) as ds:
        want = ds["tos"].values                                # land NaN, as xarray reads
    rows = src.rows(0, 0, 2)
    sea = ~land(*grid())
    np.testing.assert_array_equal(rows["mask"][1, ..., 0], sea.astype(np.float32))
    np.testing.assert_allclose(rows["target"][1, ..., 0][sea], want[2][sea])
    cmip_monthly(tmp_path / "gap.nc", 24, drop=7)                     # no August 1990
    with pytest.raises(ArrayDataError) as e:
        source(tmp_path / "gap.nc", ["tos"], nan="mask", mask=True,
               time_range=(None, None)).check()
    assert "has a gap at time[7]=1990-09-16T00:00 (previous time 1990-07-16T12:00, step 1 " \
           "month)" in str(e.value)


def test_files_of_two_calendars_are_refused_naming_both(tmp_path):
    write(tmp_path / "a.nc", dates("2000-01-01", 10, "D", "noleap"))
    write(tmp_path / "b.nc", dates("2000-01-11", 10, "D", "360_day"))
    with pytest.raises(ArrayDataError) as e:
        source(tmp_path, ["t2m"], time_range=(None, None)).check()
    assert "the files use different calendars: 360_day (file" in str(e.value)
    assert "noleap (file" in str(e.value) and "a timeline has one calendar" in str(e.value)


def test_calendar_reads_and_writes_its_own_dates():
    c = Calendar("360_day", native=False)
    t = c.parse("2019-02-30T06", "k")
    assert c.text(t) == "2019-02-30T06:00"
    assert c.text(c.parse("2019-02", "k", end=True)) == "2019-02-30T23:59"
    assert c.parse("2019-12", "k", end=True) + np.timedelta64(1, "us") == c.parse("2020", "k")
    _, axis = axis_times(np.array([cftime.datetime(2019, 2, 30, 6, calendar="360_day")]), "t")
    assert axis[0] == t
    with pytest.raises(ArrayDataError, match="calendar 'mars_sol', which spmd does not read"):
        axis_times(np.array([_Foreign()], object), "t")


class _Foreign:
    calendar = "mars_sol"
