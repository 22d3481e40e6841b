"""Stragglers of a run, for `spmd report`: the `straggler` events of events.jsonl, by rank.

The training loop's monitor (spmd.loop.stragglers) writes one `straggler` event per streak
of slow checks (a rank's host-side step time over launch.straggler_factor x the median over
ranks, 3 checks in a row, or its share of time stalled: stalled_share), with step, rank,
host, host_step_s, median_s and factor. This module only reads them: one summary per
(rank, host), over every job of the run directory, in rank order.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Straggler:
    """One rank named as a straggler, over all its events."""

    rank: int
    host: str
    steps: list[int] = field(default_factory=list)   # the step of each event
    factor_max: float = 0.0                            # its worst time over the median
    host_step_s_max: float = 0.0
    median_s: float = 0.0                              # the median at the worst event
    stalled_share_max: float = 0.0                     # named for not running: its share

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def stragglers(events: list[dict]) -> list[Straggler]:
    """The `straggler` events of `events`, one summary per (rank, host), in rank order."""
    out: dict[tuple[int, str], Straggler] = {}
    for event in events:
        if event.get("event") != "straggler":
            continue
        try:
            key = (int(event["rank"]), str(event["host"]))
            factor = float(event.get("factor", 0.0))
        except (KeyError, TypeError, ValueError):
            continue  # a malformed line: a report reads what it can
        entry = out.setdefault(key, Straggler(*key))
        if "step" in event:
            entry.steps.append(int(event["step"]))
        if isinstance(event.get("stalled_share"), int | float):
            entry.stalled_share_max = max(entry.stalled_share_max, float(event["stalled_share"]))
        if factor >= entry.factor_max:
            entry.factor_max = factor
            entry.host_step_s_max = float(event.get("host_step_s", 0.0))
            entry.median_s = float(event.get("median_s", 0.0))
    return [out[k] for k in sorted(out)]


def format_stragglers(found: list[Straggler]) -> str:
    """A few lines for the report: none, or one line per straggling rank."""
    if not found:
        return "stragglers: none named (launch.straggler_factor)"
    lines = ["stragglers (host-side step time, or time not running, over "
             "launch.straggler_factor x the median, 3 checks in a row):"]
    for s in found:
        steps = ", ".join(str(n) for n in s.steps[:8]) + (", ..." if len(s.steps) > 8 else "")
        lines.append(f"  rank {s.rank} on {s.host}: named {len(s.steps)} time(s) at step(s) "
                     f"{steps}; up to {s.factor_max:.2f}x the median ({s.host_step_s_max:.4f} s "
                     f"vs {s.median_s:.4f} s per step)"
                     + (f"; did not run (stopped or starved of CPU) for up to "
                        f"{100 * s.stalled_share_max:.0f}% of the time while the others waited"
                        if s.stalled_share_max else ""))
    return "\n".join(lines)
