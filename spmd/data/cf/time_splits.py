"""Train / test splits by time ranges of one timeline (`data.splits`).

Why: weather data are one record of the past, not independent samples; a model is tested
on years it never saw. With

    data:
      splits:
        train: {start: 2000-01-01, end: 2001-12-31T18:00}
        test:  {start: 2002-01-01, end: 2002-12-31T18:00}

both splits read the same files (or the same Zarr store): a window belongs to a split when
all its times lie in [start, end] (both ends included; either may be left out: the start
or the end of the data). As in xarray's `sel(time=slice(start, end))`, an end written as a
date is its whole day (`2001-12-31` ends at 23:59:59.999999; a month or a year likewise),
and a start is the period's first instant. Dates are dates of the data's calendar
(spmd.data.cf.calendars): `2019-02-30` is a day of a 360_day file.

Invariants:
- Splits whose ranges overlap are refused, naming both and the overlap, unless
  `data.allow_split_overlap: true`.
- A split identical to another (the same range) is always an error: a test split that is
  the train split must never be a silent default.
- A split the task asks for but `data.splits` lacks is an error naming `data.splits.<name>`,
  and so is a range that holds no window (named with the data's first and last times).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from spmd.data.cf.calendars import STANDARD, Calendar
from spmd.data.formats.stores import ArrayDataError

__all__ = ["as_time", "check_splits", "require_split", "split_range"]


def as_time(value: Any, key: str, end: bool = False,
            calendar: Calendar = STANDARD) -> np.datetime64 | None:
    """A config time (`2002-01-01`, `2002-01-01T06:00`, a YAML date) as an axis time of
    `calendar` (datetime64[us]; spmd.data.cf.calendars). With `end`, the last microsecond of
    the period written, as xarray's `sel(time=slice(..., "2002-01-01"))` reads it: a date
    is its whole day, `2002-03` the month, `2002` the year, `2002-01-01T06` the hour."""
    if value is None:
        return None
    return calendar.parse(value, key, end)


def _range(spec: Any, key: str,
           calendar: Calendar) -> tuple[np.datetime64 | None, np.datetime64 | None]:
    get = spec.get if isinstance(spec, Mapping) else lambda k: getattr(spec, k, None)
    start = as_time(get("start"), f"{key}.start", calendar=calendar)
    end = as_time(get("end"), f"{key}.end", end=True, calendar=calendar)
    if start is not None and end is not None and end < start:
        raise ArrayDataError(f"{key}: end {calendar.text(end)} is before start "
                             f"{calendar.text(start)}")
    return start, end


def check_splits(splits: Mapping[str, Any], allow_overlap: bool = False,
                 key: str = "data.splits",
                 calendar: Calendar = STANDARD) -> dict[str, tuple[Any, Any]]:
    """Every split's (start, end) as axis times of `calendar`; overlapping or identical
    ranges refused (module docstring)."""

    def _fmt(t: np.datetime64 | None, open_end: str) -> str:
        return open_end if t is None else calendar.text(t)

    ranges = {name: _range(spec, f"{key}.{name}", calendar) for name, spec in splits.items()}
    names = list(ranges)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            (sa, ea), (sb, eb) = ranges[a], ranges[b]
            if (sa, ea) == (sb, eb):
                raise ArrayDataError(
                    f"{key}.{a} and {key}.{b} are the same range ({_fmt(sa, 'start')} .. "
                    f"{_fmt(ea, 'end')}): the {b} split would be the {a} split; give them "
                    f"different dates")
            starts_before_end = (sa is None or eb is None or sa <= eb)
            ends_after_start = (ea is None or sb is None or ea >= sb)
            if starts_before_end and ends_after_start and not allow_overlap:
                over_lo = max((t for t in (sa, sb) if t is not None), default=None)
                over_hi = min((t for t in (ea, eb) if t is not None), default=None)
                raise ArrayDataError(
                    f"{key}.{a} ({_fmt(sa, 'start')} .. {_fmt(ea, 'end')}) and {key}.{b} "
                    f"({_fmt(sb, 'start')} .. {_fmt(eb, 'end')}) overlap "
                    f"({_fmt(over_lo, 'start')} .. {_fmt(over_hi, 'end')}); move the dates "
                    f"apart or set data.allow_split_overlap: true")
    return ranges


def require_split(splits: Mapping[str, Any] | None, split: str,
                  key: str = "data.splits") -> None:
    """`splits` are set and hold `split` (its dates are read later, in the data's calendar)."""
    if not splits:
        raise ArrayDataError(
            f"{key} is not set: with data.variables the train and test splits are time "
            f"ranges of the same files; set {key}.train and {key}.test, e.g. "
            f"{{train: {{end: 2001-12-31T23:00}}, test: {{start: 2002-01-01}}}} (the test "
            f"split is never the train split by default)")
    if split not in splits:
        raise ArrayDataError(f"{key}.{split} is not set (have {sorted(splits)}); give it a "
                             f"start and an end")


def split_range(splits: Mapping[str, Any] | None, split: str, allow_overlap: bool = False,
                key: str = "data.splits", calendar: Calendar = STANDARD) -> tuple[Any, Any]:
    """The (start, end) of `split` in `calendar`, after checking all of `splits` together."""
    require_split(splits, split, key)
    return check_splits(splits, allow_overlap, key, calendar)[split]
