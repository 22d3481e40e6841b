"""CF calendars: the times of every calendar on one numpy time axis.

Why: CMIP and most climate-model output use `noleap` / `365_day`, `360_day` or other CF
calendars, whose dates numpy's datetime64 cannot hold (2019-02-30 of a 360-day year).
xarray decodes them, through cftime, to arrays of `cftime.datetime`. spmd's timeline keeps
times as datetime64[us] so that order, steps and gaps stay plain numpy arithmetic:

- a time of the standard calendar, which xarray decodes to datetime64, is its date (the
  `standard` calendar here is the identity);
- a time of any other calendar (and a standard one xarray could only decode with cftime,
  such as a date before 1582) is held as its *elapsed time* since 1970-01-01 00:00 of its
  own calendar, put on the datetime64 axis. Differences are exact durations in that
  calendar (a 360_day year is 360 days, a noleap February 28 days), and order is kept.

What an axis time cannot do is name a date, so everything that names one goes through
`Calendar`: the text of a time (`text`), calendar months and years (`in_units`, for monthly
and yearly data), and a date of the config (`parse`, for data.splits) which must be a date
of the file's calendar (2019-02-30 is one of 360_day, not of noleap).

Invariants:
- For every calendar, `parse(text(t))` is t (to the minute), and `in_units` labels a time
  with its calendar month or year (as datetime64[M] / [Y] labels: year and month numbers
  carried over as they are, whatever the calendar).
- The axis is microseconds: the dates of a 500-year control run fit (datetime64[ns] would
  end in 2262).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import numpy as np

from spmd.data.data_config import DATE
from spmd.data.formats.stores import ArrayDataError

__all__ = ["AXIS", "CALENDARS", "Calendar", "STANDARD", "axis_times"]

AXIS = "datetime64[us]"                    # the unit of every timeline time
EPOCH_UNITS = "microseconds since 1970-01-01 00:00:00"
# CF's calendar names, and the one spmd calls each by (aliases as CF lists them)
CALENDARS = {"standard": "standard", "gregorian": "standard",
             "proleptic_gregorian": "proleptic_gregorian", "noleap": "noleap",
             "365_day": "noleap", "all_leap": "all_leap", "366_day": "all_leap",
             "360_day": "360_day", "julian": "julian"}
YEAR_DAYS = {"standard": 365.2425, "proleptic_gregorian": 365.2425, "noleap": 365.0,
             "all_leap": 366.0, "360_day": 360.0, "julian": 365.25}


@dataclass(frozen=True)
class Calendar:
    """A CF calendar (`name`, CF's word for it) and whether its times are numpy dates
    (`native`: the standard calendar as xarray decodes it) or elapsed times (module doc)."""

    name: str = "standard"
    native: bool = True

    def __str__(self) -> str:
        return self.name if self.native or self.name != "standard" else "standard (cftime)"

    @property
    def year_days(self) -> float:
        """Days of a mean year of this calendar (the length of a calendar-year step)."""
        return YEAR_DAYS.get(self.name, 365.2425)

    # ------------------------------------------------------------- axis -> dates

    def dates(self, times: np.ndarray) -> np.ndarray:
        """The cftime dates of axis times (a cftime calendar only)."""
        import cftime

        us = np.asarray(times).astype(AXIS).astype(np.int64)
        return np.asarray(cftime.num2date(us, EPOCH_UNITS, calendar=self.name))

    def text(self, t: Any) -> str:
        """'2019-02-30T06:00': the time `t` of the axis, to the minute."""
        if self.native:
            return str(np.datetime_as_string(np.datetime64(t, "us"), unit="m"))
        (date,) = self.dates(np.array([t]).astype(AXIS))
        return f"{date.year:04d}-{date.month:02d}-{date.day:02d}T{date.hour:02d}:" \
               f"{date.minute:02d}"

    def in_units(self, times: np.ndarray, unit: str) -> np.ndarray:
        """Each time's calendar month (unit 'M') or year ('Y'), as datetime64 labels whose
        differences count calendar months or years."""
        times = np.asarray(times)
        if self.native:
            return times.astype(f"datetime64[{unit}]")
        dates = self.dates(times)
        years = np.array([d.year for d in dates], np.int64)
        if unit == "Y":
            return (years - 1970).astype("datetime64[Y]")
        months = np.array([d.month for d in dates], np.int64)
        return ((years - 1970) * 12 + months - 1).astype("datetime64[M]")

    # ------------------------------------------------------------- dates -> axis

    def parse(self, value: Any, key: str, end: bool = False) -> np.datetime64:
        """A config date (`2019-02-30`, `2019-03-24T06:00`, a YAML date) as an axis time of
        this calendar. With `end`, the last microsecond of the period written, as xarray's
        `sel(time=slice(..., "2019-03-24"))` reads it: a date is its whole day, `2019-03`
        the month, `2019` the year, `2019-03-24T06` the hour."""
        if isinstance(value, datetime.datetime):
            value = value.replace(tzinfo=None).isoformat()
        elif isinstance(value, datetime.date):
            value = value.isoformat()
        text = str(value).strip()
        if self.native:
            return self._parse_numpy(text.replace(" ", "T"), key, end)
        m = DATE.match(text)
        if m is None:
            raise ArrayDataError(f"{key}={value!r}: not a date or time; write e.g. 2002-01-01 "
                                 f"or 2002-01-01T06:00")
        fields = [int(g) for g in m.groups() if g is not None]
        return self._parse_cftime(fields, key, value, end)

    def _parse_numpy(self, text: str, key: str, end: bool) -> np.datetime64:
        try:
            written = np.datetime64(text)              # in the unit the text is written in
        except ValueError:
            raise ArrayDataError(f"{key}={text!r}: not a date or time of the standard "
                                 f"calendar; write e.g. 2002-01-01 or 2002-01-01T06:00"
                                 ) from None
        if not end:
            return written.astype(AXIS)
        period = np.timedelta64(1, np.datetime_data(written.dtype)[0])
        return (written + period).astype(AXIS) - np.timedelta64(1, "us")

    def _parse_cftime(self, fields: list[int], key: str, value: Any,
                      end: bool) -> np.datetime64:
        import cftime

        full = fields + [1, 1, 0, 0, 0][len(fields) - 1:]       # year[, month, day, h, m, s]
        try:
            date = cftime.datetime(*full, calendar=self.name)
        except ValueError as e:
            raise ArrayDataError(f"{key}={value!r}: not a date of the data's {self.name} "
                                 f"calendar ({e})") from None
        if end:
            if len(fields) == 1:
                date = cftime.datetime(full[0] + 1, 1, 1, calendar=self.name)
            elif len(fields) == 2:
                year, month = divmod(full[0] * 12 + full[1], 12)   # the next month
                date = cftime.datetime(year, month + 1, 1, calendar=self.name)
            else:
                date = date + datetime.timedelta(**{
                    3: {"days": 1}, 4: {"hours": 1}, 5: {"minutes": 1},
                    6: {"seconds": 1}}[len(fields)])
        us = int(cftime.date2num(date, EPOCH_UNITS, calendar=self.name))
        t = np.datetime64(us, "us")
        return t - np.timedelta64(1, "us") if end else t


STANDARD = Calendar()


def axis_times(values: np.ndarray, where: str) -> tuple[Calendar, np.ndarray]:
    """The calendar of a time coordinate as xarray decoded it (datetime64, or cftime dates of
    one calendar) and its times on the axis (datetime64[us]). Anything else is an error
    naming `where`."""
    values = np.asarray(values)
    if np.issubdtype(values.dtype, np.datetime64):
        return STANDARD, values.astype(AXIS)
    first = values.flat[0] if values.size else None
    calendar = getattr(first, "calendar", None)
    if values.dtype != object or calendar is None:
        raise ArrayDataError(f"{where} is not a CF time: xarray decoded it as "
                             f"{values.dtype} (it needs units such as 'hours since "
                             f"1900-01-01' and a CF calendar)")
    name = CALENDARS.get(calendar)
    if name is None:
        raise ArrayDataError(f"{where} has calendar '{calendar}', which spmd does not read; "
                             f"it reads the CF calendars {sorted(CALENDARS)}")
    import cftime

    others = {getattr(v, "calendar", None) for v in values.flat} - {calendar}
    if others:
        raise ArrayDataError(f"{where} mixes the calendars {sorted([calendar, *others])}")
    us = np.asarray(cftime.date2num(values, EPOCH_UNITS, calendar=calendar))
    if us.dtype != np.int64:                  # cftime returns floats where not exact
        us = np.rint(us.astype(np.float64)).astype(np.int64)
    return Calendar(name, native=False), us.astype(AXIS)
