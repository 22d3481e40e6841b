"""Background reads: the host data of steps s+1 .. s+depth is read while step s runs.

A `Prefetcher` is given, per step, the independent parts of that step's read (e.g. row
ranges of this process's rows) and a `combine` that joins their results; daemon threads
run the parts, and the thread that finishes a step's last part runs its `combine` (the
feed builds the step's device arrays there: the caller only waits). `get(step)` returns
the step's result and the seconds the caller waited.

Invariants:
- What a step yields depends only on the step: the parts are the same calls a synchronous
  read makes, so prefetched batches are bit-identical to unprefetched ones, and a resumed
  run (any first step) reads the same batches.
- At most `depth` steps ahead of the last requested step are in flight; a request for a
  step that was not read ahead (a resume, a jump) reads it at once and drops what no
  longer lies ahead. Nothing is read at or beyond `until`.
- A part's (or combine's) exception is raised by `get` of the step that needs it, in the
  caller's thread, with its own message (which names the file). Steps never asked for
  never raise.
- Threads are daemons, started on first use; `close()` (also at interpreter exit) cancels
  what has not started and never waits for a read in progress beyond a short grace.
"""

from __future__ import annotations

import atexit
import functools
import queue
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

Part = Callable[[], Any]
Plan = Callable[[int], tuple[list[Part], Callable[[list[Any]], Any]]]

_LIVE: weakref.WeakSet[ReadPool] = weakref.WeakSet()


class ReadPool:
    """`threads` daemon threads running submitted callables (FIFO)."""

    def __init__(self, threads: int, name: str = "spmd-read"):
        self.threads, self.name = max(1, int(threads)), name
        self._queue: queue.SimpleQueue[tuple[Future, Part] | None] = queue.SimpleQueue()
        self._workers: list[threading.Thread] = []
        self._closed = False
        self._lock = threading.Lock()
        _LIVE.add(self)

    def submit(self, fn: Part) -> Future:
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name}: read pool is closed")
            if not self._workers:
                for i in range(self.threads):
                    t = threading.Thread(target=_work, args=(self._queue,),
                                         name=f"{self.name}-{i}", daemon=True)
                    t.start()
                    self._workers.append(t)
            self._queue.put((future, fn))
        return future

    def close(self, grace_s: float = 1.0) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            workers, self._workers = self._workers, []
        while True:                       # cancel what has not started
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        for _ in workers:
            self._queue.put(None)
        deadline = time.monotonic() + grace_s
        for t in workers:
            t.join(max(0.0, deadline - time.monotonic()))


def _work(jobs: queue.SimpleQueue) -> None:
    while True:
        item = jobs.get()
        if item is None:
            return
        future, fn = item
        if not future.set_running_or_notify_cancel():
            continue
        try:
            future.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - re-raised by the step that needs it
            future.set_exception(e)


@atexit.register
def _close_all() -> None:
    for pool in list(_LIVE):
        pool.close(grace_s=0.5)


class _Pending:
    """One step in flight: its parts in the pool; the last part to finish runs `combine`
    and completes `done` (a part's exception completes it at once)."""

    def __init__(self, parts: list[Part], combine: Callable[[list[Any]], Any], pool: ReadPool):
        self.done: Future = Future()
        self.combine = combine
        self._results: list[Any] = [None] * len(parts)
        self._left = len(parts)
        self._lock = threading.Lock()
        if not parts:
            self._finish()
        self.futures = [pool.submit(functools.partial(self._run, k, part))
                        for k, part in enumerate(parts)]

    def _run(self, k: int, part: Part) -> None:
        try:
            value = part()
        except BaseException as e:  # noqa: BLE001 - raised by get() of the step
            with self._lock:
                if not self.done.done():
                    self.done.set_exception(e)
            return
        with self._lock:
            self._results[k] = value
            self._left -= 1
            last = self._left == 0 and not self.done.done()
        if last:
            self._finish()

    def _finish(self) -> None:
        try:
            result = self.combine(self._results)
        except BaseException as e:  # noqa: BLE001 - raised by get() of the step
            self.done.set_exception(e)
        else:
            self.done.set_result(result)

    def cancel(self) -> None:
        for f in self.futures:
            f.cancel()


class Prefetcher:
    """Reads the steps after the requested one ahead, `depth` of them, with `threads`."""

    def __init__(self, plan: Plan, depth: int, threads: int, *, until: int | None = None,
                 name: str = "spmd-read"):
        self.plan, self.depth, self.until = plan, max(0, int(depth)), until
        self.pool = ReadPool(threads, name)
        self._pending: dict[int, _Pending] = {}
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def _schedule(self, step: int) -> None:
        parts, combine = self.plan(step)
        self._pending[step] = _Pending(parts, combine, self.pool)

    def get(self, step: int) -> tuple[Any, float]:
        """Step `step`'s result and the seconds spent waiting for it; reads ahead."""
        with self._lock:
            ahead = range(step + 1, step + 1 + self.depth)
            for s in [s for s in self._pending if s != step and s not in ahead]:
                self._pending.pop(s).cancel()
            if step in self._pending:
                self.hits += 1
            else:
                self.misses += 1
                self._schedule(step)
            pending = self._pending.pop(step)
            for s in ahead:
                if (self.until is None or s < self.until) and s not in self._pending:
                    self._schedule(s)
        began = time.perf_counter()
        result = pending.done.result()
        waited = time.perf_counter() - began
        return result, waited

    def close(self) -> None:
        with self._lock:
            for pending in self._pending.values():
                pending.cancel()
            self._pending.clear()
        self.pool.close()
