"""Variables and pressure levels as the channels of a frame (`data.variables`,
`data.constants`).

Why: a weather model's state is several variables (t2m, u10, v10) and some variables at
several levels (geopotential at 500 and 850 hPa), stacked along the channel axis. The
config names them once, in order:

    data:
      variables: [t2m, u10, v10, {geopotential: [500, 850]}]
      constants: [lsm, orography, latitude, longitude]

Invariants:
- The channel order is the order written: each variable in turn, its levels in the order
  listed (never sorted), so channel k means the same in every file, run and checkpoint.
  `channel_table` prints it (`spmd data info`).
- A channel is named `<variable>` or `<variable>_<level>` (geopotential_500).
- A variable named twice, or a level named twice for one variable, is an error naming
  `data.variables`.
- Constants are time-free fields, in the order written: a variable without a time
  dimension in the files (orography, land-sea mask), or `latitude` / `longitude`, the
  coordinate's value at each grid point (degrees). They are extra input channels only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from spmd.data.formats.stores import ArrayDataError

__all__ = ["COORDINATE_CONSTANTS", "Channel", "channel_table", "parse_channels"]

COORDINATE_CONSTANTS = ("latitude", "longitude")


@dataclass(frozen=True)
class Channel:
    """One channel of a frame: `variable`, at `level` (None: a variable without levels)."""

    variable: str
    level: float | int | None = None

    @property
    def name(self) -> str:
        if self.level is None:
            return self.variable
        level = int(self.level) if float(self.level).is_integer() else self.level
        return f"{self.variable}_{level}"


def parse_channels(spec: Sequence[Any] | None, key: str = "data.variables") -> list[Channel]:
    """The channels of a `data.variables` list (names, or {name: [levels]} mappings)."""
    if not spec:
        raise ArrayDataError(f"{key} is empty: name the variables to stack as channels, "
                             f"e.g. [t2m, u10, v10, {{geopotential: [500, 850]}}]")
    out: list[Channel] = []
    seen: set[str] = set()
    for entry in spec:
        items = entry.items() if isinstance(entry, dict) else [(entry, None)]
        for name, levels in items:
            if not isinstance(name, str) or not name:
                raise ArrayDataError(f"{key}: entry {entry!r} is not a variable name or a "
                                     f"{{variable: [levels]}} mapping")
            if name in seen:
                raise ArrayDataError(f"{key}: variable '{name}' is named twice; name it once "
                                     f"(with all its levels)")
            seen.add(name)
            if levels is None:
                out.append(Channel(name))
                continue
            if not isinstance(levels, (list, tuple)) or not levels:
                raise ArrayDataError(f"{key}: levels of '{name}' must be a non-empty list, "
                                     f"got {levels!r}")
            if len(set(levels)) != len(levels):
                raise ArrayDataError(f"{key}: variable '{name}' lists a level twice: "
                                     f"{list(levels)}")
            for level in levels:
                if isinstance(level, bool) or not isinstance(level, (int, float)):
                    raise ArrayDataError(f"{key}: level {level!r} of '{name}' is not a number")
                out.append(Channel(name, level))
    return out


def channel_table(channels: Sequence[Channel], constants: Sequence[str] = (),
                  units: dict[str, str] | None = None) -> str:
    """The channel table: index, name, variable, level, units; then the constants."""
    units = units or {}
    lines = [f"{'channel':>7}  {'name':<24} {'variable':<20} {'level':>7}  units"]
    for i, c in enumerate(channels):
        level = "-" if c.level is None else f"{c.level:g}"
        lines.append(f"{i:>7}  {c.name:<24} {c.variable:<20} {level:>7}  "
                     f"{units.get(c.variable, '')}")
    for i, name in enumerate(constants):
        lines.append(f"{'c' + str(i):>7}  {name:<24} {name:<20} {'-':>7}  "
                     f"{'degrees' if name in COORDINATE_CONSTANTS else units.get(name, '')}"
                     f"  (constant input)")
    return "\n".join(lines)
