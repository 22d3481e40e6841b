"""Background reads: the host data of steps s+1 .. s+depth is read while step s runs.

A `Prefetcher` is given, per step, the independent parts of that step's read (e.g. row
ranges of this process's rows) and a `combine` that joins their results; daemon threads
run the parts, and the thread that finishes a step's last part runs its `combine` (the
feed builds the step's device arrays there: the caller only waits). `get(step)` returns
the step's result and the seconds the caller waited.

How: one condition variable guards a window of steps, [last requested, + depth]. Each
read thread takes the lowest step of the window nobody has started (it plans the step,
then runs its first part) or a part of a started step nobody has taken, runs it, and
stores the result; the caller waits on a second condition over the same lock. No future,
queue or task object per step: a hand-off between threads costs a wake-up each way, which
in a loop that only fetches batches was a third of the time (docs/performance.md section
7). For the same reason a caller that has to wait (the reads are slower than its steps)
waits for the whole window, which it then takes without a wake-up per step, but never
longer than twice what the window takes at the recent pace: a done step is not held back
by a read that hangs.

Invariants:
- What a step yields depends only on the step: the parts are the same calls a synchronous
  read makes, so prefetched batches are bit-identical to unprefetched ones, and a resumed
  run (any first step) reads the same batches.
- At most `depth` steps ahead of the last requested step are in flight, lowest first; a
  request for a step that was not read ahead (a resume, a jump) is read before any other
  and drops what no longer lies ahead. Nothing ahead is read at or beyond `until`.
- A part's (or combine's) exception is raised by `get` of the step that needs it, in the
  caller's thread, with its own message (which names the file). Steps never asked for
  never raise.
- Threads are daemons, started on first use; `close()` (also at interpreter exit) drops
  what has not started and never waits for a read in progress beyond a short grace.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

Part = Callable[[], Any]
Plan = Callable[[int], tuple[list[Part], Callable[[list[Any]], Any]]]

_LIVE: weakref.WeakSet[Prefetcher] = weakref.WeakSet()


class _Step:
    """One step in the window: planned by the thread that takes it first; its parts are
    taken in order (`taken`); `left` counts those not finished."""

    __slots__ = ("parts", "combine", "results", "taken", "left", "done", "value", "error",
                 "began")

    def __init__(self) -> None:
        self.parts: list[Part] | None = None          # None: being planned
        self.combine: Callable[[list[Any]], Any] | None = None
        self.results: list[Any] = []
        self.taken = self.left = 0
        self.done = False
        self.value: Any = None
        self.error: BaseException | None = None
        self.began = time.perf_counter()


class Prefetcher:
    """Reads the steps after the requested one ahead, `depth` of them, with `threads`."""

    def __init__(self, plan: Plan, depth: int, threads: int, *, until: int | None = None,
                 name: str = "spmd-read"):
        self.plan, self.depth, self.until = plan, max(0, int(depth)), until
        self.threads, self.name = max(1, int(threads)), name
        self.hits = self.misses = 0
        lock = threading.Lock()
        self._cv = threading.Condition(lock)          # the read threads wait here
        self._caller = threading.Condition(lock)      # the caller waits here
        self._awaited: tuple[int, int] | None = None  # (step, last) the caller waits for
        self._idle = 0                                # read threads waiting for work
        self._pace_s: float | None = None             # recent seconds per step read
        self._steps: dict[int, _Step] = {}
        self._want: int | None = None                 # the last requested step
        self._given: int | None = None                # the last step handed to the caller
        self._workers: list[threading.Thread] = []
        self._closed = False
        _LIVE.add(self)

    # ------------------------------------------------------------ the caller

    def get(self, step: int) -> tuple[Any, float]:
        """Step `step`'s result and the seconds spent waiting for it; reads ahead."""
        with self._cv:
            if self._closed:
                raise RuntimeError(f"{self.name}: the reader is closed")
            self._want, self._given = step, None
            for s in [s for s in self._steps if not step <= s <= step + self.depth]:
                del self._steps[s]                    # no longer ahead (a jump, a resume)
            if step in self._steps:
                self.hits += 1
            else:
                self.misses += 1
            if not self._workers:
                for i in range(self.threads):
                    t = threading.Thread(target=self._work, name=f"{self.name}-{i}",
                                         daemon=True)
                    t.start()
                    self._workers.append(t)
            if self._idle:
                self._cv.notify_all()
            began = time.perf_counter()
            if (done := self._steps.get(step)) is None or not done.done:
                self._wait_for(step, began)
                done = self._steps[step]
            del self._steps[step]
            self._given = step
            waited = time.perf_counter() - began
        if done.error is not None:
            raise done.error
        return done.value, waited

    def close(self, grace_s: float = 1.0) -> None:
        with self._cv:
            if self._closed:
                return
            self._closed = True
            self._steps.clear()
            workers, self._workers = self._workers, []
            self._cv.notify_all()
            self._caller.notify_all()
        deadline = time.monotonic() + grace_s
        for t in workers:
            t.join(max(0.0, deadline - time.monotonic()))

    def _wait_for(self, step: int, began: float) -> None:
        """Wait until `step` is done. Starved (this is a wait), wait for the whole window
        too, so that the next steps are handed over without a wake-up each; but never
        longer than twice what reading the window takes at the recent pace (a read that
        hangs must not hold back a step that is done). Called holding the lock."""
        last, deadline = step, None
        if self._pace_s is not None and (self.until is None or step + 1 < self.until):
            last = step + self.depth if self.until is None \
                else min(step + self.depth, self.until - 1)
            deadline = began + 2 * self._pace_s * (last - step + 1)
        self._awaited = (step, last)
        try:
            while not self._ready(*self._awaited):
                if self._closed:
                    raise RuntimeError(f"{self.name}: the reader was closed")
                if deadline is None:
                    self._caller.wait()
                elif (left := deadline - time.perf_counter()) > 0:
                    self._caller.wait(left)
                else:                                 # past it: this step only
                    self._awaited, deadline = (step, step), None
        finally:
            self._awaited = None

    def _ready(self, step: int, last: int) -> bool:
        """Whether the caller, waiting for `step`, can go on: the step failed, or it and
        every step after it up to `last` are done. Called holding the lock."""
        first = self._steps.get(step)
        if first is None or not first.done:
            return False
        if first.error is not None:
            return True
        return all((r := self._steps.get(s)) is not None and r.done
                   for s in range(step + 1, last + 1))

    # ------------------------------------------------------------ the read threads

    def _take(self) -> tuple[int, _Step, int | None] | None:
        """(step, its record, part to run or None: plan it first), lowest step first;
        None when the window holds nothing to do. Called holding the condition."""
        if self._want is None:
            return None
        first = self._want + (self._given == self._want)      # not the one handed over
        for s in range(first, self._want + self.depth + 1):
            if s > self._want and self.until is not None and s >= self.until:
                break
            record = self._steps.get(s)
            if record is None:
                record = self._steps[s] = _Step()
                return s, record, None
            if record.parts is not None and record.taken < len(record.parts) \
                    and not record.done:
                record.taken += 1
                return s, record, record.taken - 1
        return None

    def _work(self) -> None:
        while True:
            with self._cv:
                while True:
                    if self._closed:
                        return
                    job = self._take()
                    if job is not None:
                        break
                    self._idle += 1
                    self._cv.wait()
                    self._idle -= 1
            self._run(*job)

    def _run(self, step: int, record: _Step, part: int | None) -> None:
        try:
            if part is None:                          # first taker: plan, then part 0
                parts, combine = self.plan(step)
                with self._cv:
                    record.parts, record.combine = parts, combine
                    record.results, record.left = [None] * len(parts), len(parts)
                    record.taken = min(1, len(parts))
                    if len(parts) > 1:
                        self._cv.notify_all()         # the other parts are free to take
                if not parts:
                    self._finish(record, combine([]), None)
                    return
                part = 0
            value = record.parts[part]()
        except BaseException as e:  # noqa: BLE001 - raised by get() of the step
            self._finish(record, None, e)
            return
        with self._cv:
            record.results[part] = value
            record.left -= 1
            last = record.left == 0 and not record.done
        if last:                                      # this thread joins the step
            try:
                value = record.combine(record.results)
            except BaseException as e:  # noqa: BLE001 - raised by get() of the step
                self._finish(record, None, e)
                return
            self._finish(record, value, None)

    def _finish(self, record: _Step, value: Any, error: BaseException | None) -> None:
        with self._cv:
            if not record.done:
                record.value, record.error, record.done = value, error, True
                took = time.perf_counter() - record.began
                self._pace_s = took if self._pace_s is None else \
                    0.8 * self._pace_s + 0.2 * took
            if self._awaited is not None and self._ready(*self._awaited):
                self._caller.notify()


@atexit.register
def _close_all() -> None:
    for reader in list(_LIVE):
        reader.close(grace_s=0.5)
