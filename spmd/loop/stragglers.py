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

A rank that stalls (stopped, starved of CPU, swapped out: it does not run at all) while the
others wait for it inside a collective makes every rank's host step time long: a fast rank's
host waits for its device, whose step waits in the gradient reduction for the stalled rank.
The host step time cannot tell which rank held the others back; the *stalled share* can.
`StallMeter`, a daemon thread of each process, wakes every `TICK_S` and counts every wake
that comes `STALL_MIN_S` or more late as time the process did not run; a rank that only
waits for others keeps waking on time. Each rank sends the share of the wall time it
stalled over its last `in_a_row` check intervals (a window: a stall of half a second every
second falls in some intervals only).

Invariants
- A check is a collective (`group.allgather_str`): it runs at the steps that are multiples
  of `log_every`, which every rank reaches in the same order, and nowhere else. It gathers
  each rank's mean host step time since its previous check, its stalled share and its host
  name (as the text "SECONDS STALLED HOST"; "SECONDS HOST" reads as a share of 0).
- The first check step after the monitor is built gathers nothing and reports nothing: its
  interval holds the first step, which has no departure mark, and the first executions
  after compilation or a restore (warm-up). Every rank skips the same step.
- `fields(step)` is the check's metrics at a check step (`host_step_s_min`, `..._median`,
  `..._max`, `slowest_rank`, `slowest_host`; the slowest is the lowest rank among equals),
  the same on every rank, and {} at any other step. One process: the same fields
  (min = median = max), no communication.
- A rank is slow at a check when its time exceeds `factor` x the median over ranks and the
  median by more than `min_excess_s` (sub-millisecond jitter is no straggler), or when its
  stalled share exceeds `factor` x the median share and the median by more than
  `STALL_MIN_SHARE` (a rank that did not run for 15% of the time more than the median: a
  busy node starves a rank now and then; with 2 ranks the median is the mean of the two).
  Slow at `in_a_row` (3) checks in a row, it is named once per such streak: a WARNING on
  rank 0 (`is_main`) and on the rank itself, and, from rank 0 only, an event `straggler` in
  events.jsonl with step, rank, host, host_step_s, median_s and factor (its time over the
  median); `threshold` is the configured factor (launch.straggler_factor). Named while it
  stalls, the event also has cause "stalled", stalled_share and median_stalled_share, even
  when its host time is long too: a rank that did not run is slow for that reason.
- The stall meter runs only while a monitor that reads the real clock has started training
  (its first `depart`), and stops when no such monitor is left. A monitor given another
  `clock` reads no stalls unless it is given `stalled` (seconds stalled so far).
- Nothing here synchronizes with a device: the monitor reads a host clock only.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from spmd.loop.hooks import StepInfo, Stop

log = logging.getLogger("spmd.loop.stragglers")

IN_A_ROW = 3          # slow checks in a row that make a straggler
MIN_EXCESS_S = 0.001  # a rank is slow only when it is also this much over the median
TICK_S = 0.02         # the stall meter's period
STALL_MIN_S = 0.05    # a wake this late or later is a stall (scheduler noise is shorter)
STALL_MIN_SHARE = 0.15  # a rank stalls too much when this share of the time over the median


class StallMeter:
    """Seconds this process did not run, counted by a daemon thread (one per process,
    shared by every monitor that uses it; it ends when none is left)."""

    _lock = threading.Lock()
    _users = 0
    _stalled = 0.0
    _thread: threading.Thread | None = None

    @classmethod
    def acquire(cls, owner: object) -> None:
        """Count stalls while `owner` lives (the thread starts with the first owner)."""
        with cls._lock:
            cls._users += 1
            if cls._thread is None:
                cls._thread = threading.Thread(target=cls._run, name="spmd-stall-meter",
                                               daemon=True)
                cls._thread.start()
        weakref.finalize(owner, cls._release)

    @classmethod
    def _release(cls) -> None:
        with cls._lock:
            cls._users -= 1

    @classmethod
    def stalled(cls) -> float:
        """Seconds stalled since this process started metering."""
        return cls._stalled

    @classmethod
    def _run(cls) -> None:
        last = time.monotonic()
        while True:
            time.sleep(TICK_S)
            now = time.monotonic()
            late = now - last - TICK_S
            last = now
            with cls._lock:
                if late >= STALL_MIN_S:
                    cls._stalled += late
                if cls._users <= 0:
                    cls._thread = None
                    return


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
                 clock: Callable[[], float] = time.perf_counter,
                 stalled: Callable[[], float] | None = None):
        """`group`: the ranks (None: this process alone); `log_every`: steps between checks
        (run.log_every); `factor`: launch.straggler_factor; `events`: where rank 0 writes the
        `straggler` events; `stalled`: seconds this process stalled so far (default: the
        process's StallMeter with the real clock, none with another)."""
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
        self._meter = stalled is None and clock is time.perf_counter
        self._stalled = stalled or (StallMeter.stalled if self._meter else (lambda: 0.0))
        self._mark: tuple[float, float] | None = None  # (clock, stalled) at the last check
        self._window: deque[tuple[float, float]] = deque(maxlen=in_a_row)  # (stalled, wall)

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
        if self._meter:   # training has started: meter this process's stalls from now on
            self._meter = False
            StallMeter.acquire(self)
        return None

    def fields(self, step: int) -> dict[str, Any]:
        """The metric fields of the check at `step` (every rank), {} if `step` had none."""
        at, fields = self._fields
        return dict(fields) if at == step else {}

    # ------------------------------------------------------------------ the check

    def _share(self) -> float:
        """The share of the wall time this rank stalled over its last `in_a_row` intervals."""
        now, stalled = self.clock(), self._stalled()
        if self._mark is not None:
            self._window.append((stalled - self._mark[1], now - self._mark[0]))
        self._mark = (now, stalled)
        wall = sum(w for _, w in self._window)
        return min(1.0, sum(s for s, _ in self._window) / wall) if wall > 0 else 0.0

    def _check(self, step: int) -> None:
        mean = self._total / self._count if self._count else 0.0
        self._total, self._count = 0.0, 0
        share = self._share()
        if not self._warm:  # the warm-up interval: every rank skips this same step
            self._warm = True
            return
        mine = f"{mean:.9g} {share:.4g} {self.host}"
        if self.group is None:
            rows = [mine]
        else:
            rows = self.group.allgather_str(mine, f"gather host step times at step {step}")
        times, shares, hosts = [], [], []
        for rank, row in enumerate(rows):
            seconds, _, host = row.partition(" ")
            stalled, _, rest = host.partition(" ")
            try:
                times.append(float(seconds))
                shares.append(float(stalled) if rest else 0.0)
            except ValueError:
                raise ValueError(f"rank {self.rank} on {self.host}: rank {rank}'s host step "
                                 f"time at step {step} is not 'SECONDS STALLED HOST': {row!r}"
                                 ) from None
            hosts.append(rest or host)
        median = statistics.median(times)
        median_share = statistics.median(shares)
        slowest = max(range(len(times)), key=lambda r: (times[r], -r))
        self._fields = (step, {
            "host_step_s_min": round(min(times), 6), "host_step_s_median": round(median, 6),
            "host_step_s_max": round(times[slowest], 6), "slowest_rank": slowest,
            "slowest_host": hosts[slowest]})
        for rank, seconds in enumerate(times):
            slow = seconds > self.factor * median and seconds - median > self.min_excess_s
            stalls = (shares[rank] > self.factor * median_share
                      and shares[rank] - median_share > STALL_MIN_SHARE)
            self._streak[rank] = self._streak.get(rank, 0) + 1 if slow or stalls else 0
            if self._streak[rank] == self.in_a_row:
                self._name(step, rank, hosts[rank], seconds, median,
                           (shares[rank], median_share) if stalls else None)

    def _name(self, step: int, rank: int, host: str, seconds: float, median: float,
              stalled: tuple[float, float] | None) -> None:
        """Name `rank` (for its host step time, or for the share of the time it `stalled`:
        (its share, the median share))."""
        ratio = seconds / median if median > 0 else float("inf")
        if self.is_main or rank == self.rank:
            if stalled is None:
                log.warning("straggler: rank %d on %s took %.4f s of host time per step, "
                            "%.2fx the median %.4f s over %d ranks, at %d checks in a row up "
                            "to step %d (launch.straggler_factor=%g)", rank, host, seconds,
                            ratio, median, len(self._streak), self.in_a_row, step, self.factor)
            else:
                log.warning("straggler: rank %d on %s did not run (stopped or starved of CPU) "
                            "for %.0f%% of the time, the median over %d ranks %.0f%%, at %d "
                            "checks in a row up to step %d: the others waited for it inside "
                            "collectives (launch.straggler_factor=%g)", rank, host,
                            100 * stalled[0], len(self._streak), 100 * stalled[1],
                            self.in_a_row, step, self.factor)
        if self.is_main and self.events is not None:
            extra = {} if stalled is None else {
                "cause": "stalled", "stalled_share": round(stalled[0], 4),
                "median_stalled_share": round(stalled[1], 4)}
            self.events.emit("straggler", step=step, rank=rank, host=host,
                             host_step_s=round(seconds, 6), median_s=round(median, 6),
                             factor=round(ratio, 3),
                             threshold=self.factor, **extra)
