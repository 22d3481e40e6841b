"""Straggler detection: every rank's host-side step time, gathered every `run.log_every` steps.

A rank's *host-side step time* of step k is the time from the moment its host left the
preemption vote of step k-1 to the moment it reaches the hooks of step k: its data loading
(`rt.feed.global_batch`), the dispatch of the update and the hooks that run after the vote.
The vote (spmd.comm.stop_vote) is an allreduce at every step, so every rank leaves it at
nearly the same moment; a fast rank's wait for a slow one falls inside the vote, outside
this time. `StragglerMonitor` measures it with two hook functions of the loop's signature
(spmd.loop.hooks):

    arrive   registered FIRST, every step: ends step k's interval; at a check step, gathers
    depart   registered right AFTER the preemption hook, every step: starts step k+1's

    monitor = StragglerMonitor(group, env.rank, host, cfg.run.log_every,
                               cfg.launch.straggler_factor, events, is_main)
    hooks = [Hook(monitor.arrive, 1, "stragglers"), <profiler>, Hook(preemption, 1, ...),
             Hook(monitor.depart, 1, "stragglers-depart"), ...]
    record.update(monitor.fields(info.step))      # in the metrics hook, at logged steps

Invariants
- A check is a collective (`group.allgather_str`): it runs at the steps that are multiples
  of `log_every`, which every rank reaches in the same order, and nowhere else. It gathers
  each rank's mean host step time since its previous check and its host name (as the text
  "SECONDS HOST", split at the first space).
- The first check step after the monitor is built gathers nothing and reports nothing: its
  interval holds the first step, which has no departure mark, and the first executions
  after compilation or a restore (warm-up). Every rank skips the same step.
- `fields(step)` is the check's metrics at a check step (`host_step_s_min`, `..._median`,
  `..._max`, `slowest_rank`, `slowest_host`; the slowest is the lowest rank among equals),
  the same on every rank, and {} at any other step. One process: the same fields
  (min = median = max), no communication.
- A rank is slow at a check when its time exceeds `factor` x the median over ranks and the
  median by more than `min_excess_s` (sub-millisecond jitter is no straggler). Slow at
  `in_a_row` (3) checks in a row, it is named once per such streak: a WARNING on rank 0
  (`is_main`) and on the rank itself, and, from rank 0 only, an event `straggler` in
  events.jsonl with step, rank, host, host_step_s, median_s and factor (its time over the
  median); `threshold` is the configured factor (launch.straggler_factor).
- Nothing here synchronizes with a device: the monitor reads a host clock only.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from typing import Any, Protocol

from spmd.loop.hooks import StepInfo, Stop

log = logging.getLogger("spmd.loop.stragglers")

IN_A_ROW = 3          # slow checks in a row that make a straggler
MIN_EXCESS_S = 0.001  # a rank is slow only when it is also this much over the median


class GatherGroup(Protocol):
    """What the monitor needs of a `spmd.comm.RankGroup`: one collective."""

    def allgather_str(self, text: str, what: str) -> list[str]: ...


class EventSink(Protocol):
    """What the monitor needs of a `spmd.rundir.metrics.EventLog`."""

    def emit(self, event: str, **fields: Any) -> None: ...


class StragglerMonitor:
    """This rank's host-side step times, compared with every other rank's at each check."""

    def __init__(self, group: GatherGroup | None, rank: int, host: str, log_every: int,
                 factor: float, events: EventSink | None, is_main: bool, *,
                 in_a_row: int = IN_A_ROW, min_excess_s: float = MIN_EXCESS_S,
                 clock: Callable[[], float] = time.perf_counter):
        """`group`: the ranks (None: this process alone); `log_every`: steps between checks
        (run.log_every); `factor`: launch.straggler_factor; `events`: where rank 0 writes the
        `straggler` events."""
        if log_every < 1:
            raise ValueError(f"rank {rank} on {host}: run.log_every={log_every} must be >= 1")
        if factor <= 1:
            raise ValueError(f"rank {rank} on {host}: launch.straggler_factor={factor} must "
                             "be > 1")
        self.group, self.rank, self.host = group, rank, host
        self.log_every, self.factor, self.events, self.is_main = log_every, factor, events, is_main
        self.in_a_row, self.min_excess_s, self.clock = in_a_row, min_excess_s, clock
        self._left: float | None = None   # when this host left the previous step's vote
        self._total, self._count = 0.0, 0  # host step time since the previous check
        self._warm = False                 # the first check step has been passed
        self._streak: dict[int, int] = {}  # rank -> slow checks in a row
        self._fields: tuple[int, dict[str, Any]] = (-1, {})

    # ------------------------------------------------------------------ the two hooks

    def arrive(self, info: StepInfo) -> Stop | None:
        """First hook of every step: ends this step's interval; a check at multiples of
        log_every (a collective on every rank)."""
        now = self.clock()
        if self._left is not None:
            self._total += now - self._left
            self._count += 1
            self._left = None
        if info.step % self.log_every == 0:
            self._check(info.step)
        return None

    def depart(self, info: StepInfo) -> Stop | None:
        """Right after the preemption vote of every step: the next step's interval starts."""
        self._left = self.clock()
        return None

    def fields(self, step: int) -> dict[str, Any]:
        """The metric fields of the check at `step` (every rank), {} if `step` had none."""
        at, fields = self._fields
        return dict(fields) if at == step else {}

    # ------------------------------------------------------------------ the check

    def _check(self, step: int) -> None:
        mean = self._total / self._count if self._count else 0.0
        self._total, self._count = 0.0, 0
        if not self._warm:  # the warm-up interval: every rank skips this same step
            self._warm = True
            return
        mine = f"{mean:.9g} {self.host}"
        if self.group is None:
            rows = [mine]
        else:
            rows = self.group.allgather_str(mine, f"gather host step times at step {step}")
        times, hosts = [], []
        for rank, row in enumerate(rows):
            seconds, _, host = row.partition(" ")
            try:
                times.append(float(seconds))
            except ValueError:
                raise ValueError(f"rank {self.rank} on {self.host}: rank {rank}'s host step "
                                 f"time at step {step} is not 'SECONDS HOST': {row!r}") from None
            hosts.append(host)
        median = statistics.median(times)
        slowest = max(range(len(times)), key=lambda r: (times[r], -r))
        self._fields = (step, {
            "host_step_s_min": round(min(times), 6), "host_step_s_median": round(median, 6),
            "host_step_s_max": round(times[slowest], 6), "slowest_rank": slowest,
            "slowest_host": hosts[slowest]})
        for rank, seconds in enumerate(times):
            slow = seconds > self.factor * median and seconds - median > self.min_excess_s
            self._streak[rank] = self._streak.get(rank, 0) + 1 if slow else 0
            if self._streak[rank] == self.in_a_row:
                self._name(step, rank, hosts[rank], seconds, median)

    def _name(self, step: int, rank: int, host: str, seconds: float, median: float) -> None:
        ratio = seconds / median if median > 0 else float("inf")
        if self.is_main or rank == self.rank:
            log.warning("straggler: rank %d on %s took %.4f s of host time per step, %.2fx the "
                        "median %.4f s over %d ranks, at %d checks in a row up to step %d "
                        "(launch.straggler_factor=%g)", rank, host, seconds, ratio, median,
                        len(self._streak), self.in_a_row, step, self.factor)
        if self.is_main and self.events is not None:
            self.events.emit("straggler", step=step, rank=rank, host=host,
                             host_step_s=round(seconds, 6), median_s=round(median, 6),
                             factor=round(ratio, 3), threshold=self.factor)
