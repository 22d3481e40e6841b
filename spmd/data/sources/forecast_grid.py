"""The coordinates of predictions made from gridded windows (`spmd predict` on a run that
trained on data.variables): what a forecast file needs so that xarray opens it with its
times, latitudes, longitudes and channel names.

Invariants:
- Record i of a prediction belongs to window i of the source in time order (predict reads
  without shuffling); its initial time is the window's last input frame, and lead k
  (1 .. rollout) is k steps of the data's time step after it.
- Times are axis times of the data's calendar (spmd.data.cf.calendars): as "hours since
  1970-01-01 00:00:00" in that calendar they are written exactly, whatever the calendar.
- A calendar-month or -year step has no fixed length: such a forecast has leads in steps
  but no `valid_time`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from spmd.data.cf.calendars import Calendar
from spmd.data.cf.channels import Channel
from spmd.data.cf.gridded_timeline import CALENDAR_UNITS, Timeline, step_text

__all__ = ["ForecastGrid", "forecast_grid"]

TIME_UNITS = "hours since 1970-01-01 00:00:00"


@dataclass(frozen=True)
class ForecastGrid:
    """Where each predicted frame lies: per record its initial time, the grid, the
    channels (names and units), the calendar and the step."""

    init_times: np.ndarray                 # axis times (datetime64[us]), one per record
    lat: np.ndarray
    lon: np.ndarray
    channels: list[str]
    units: list[str]
    calendar: Calendar
    step: np.timedelta64

    @property
    def fixed_step(self) -> bool:
        """Whether the step is a duration (hours), not a calendar month or year."""
        return np.datetime_data(self.step.dtype)[0] not in CALENDAR_UNITS

    def step_text(self) -> str:
        return step_text(self.step)

    def hours(self, times: np.ndarray) -> np.ndarray:
        """Axis times as float64 `TIME_UNITS` of the calendar (exact to the microsecond)."""
        us = np.asarray(times).astype("datetime64[us]").astype(np.int64)
        return us / 3.6e9

    def step_hours(self) -> float:
        return float(self.step / np.timedelta64(1, "h"))



def forecast_grid(timeline: Timeline, channels: Sequence[Channel],
                  init_times: np.ndarray) -> ForecastGrid:
    """The ForecastGrid of records starting at `init_times` (axis times of `timeline`) with
    `channels`, their units as the first file states them."""
    variables = timeline.files[0].variables
    units = [variables[c.variable].units if c.variable in variables else ""
             for c in channels]
    return ForecastGrid(np.asarray(init_times, "datetime64[us]"), np.asarray(timeline.lat),
                        np.asarray(timeline.lon), [c.name for c in channels], units,
                        timeline.calendar, timeline.step)
