"""A preemption signal before the first training step ends every rank at once, with status 75.

Why: until the first update there is nothing to save (a restored state is committed
already, a fresh one is made again from the seed), while preparing the data, restoring and
compiling may take minutes: longer than a scheduler's grace period. Waiting for the first
step's stop vote (spmd.comm.StopVote) would spend that grace period for nothing, and a rank
inside `Task.prepare` or a compile cannot vote anyway.

How (`EarlyStop(watcher, env)`, armed from bootstrap's end to `disarm()` before the first
step): a daemon thread waits on the process's `PreemptionWatcher.event` (set by its signal
handler, which only records). When it is set while armed, the thread logs one line,
records a `preempted` event (`before_training`, once the run has its event log: `spmd
report` names the end), runs the `on_end` callbacks (the lease's release), announces
status 75 to the job
(`spmd.comm.job_failure.announce`: every other rank's FailureWatch ends it with the same
status, so ranks that did not see the signal end too, and none waits for a collective
that will not come), and ends this rank with `end_process(75)`.

Invariants
- `held()` marks a short local write that must not be cut (config.yaml, metrics.jsonl): the
  end waits for it, whether this rank's thread or another rank's announcement ends it (the
  trainer gives `before_end` to its FailureWatch).
- `disarm()` and the end exclude each other: after `disarm()` returns, a signal is left to
  the stop vote at the next step (save, then 75); a disarm that comes after the end began
  blocks until the process is gone.
- A signal received before `start` (between bootstrap's first line and here) is acted on at
  once by `start`.
- `Task.prepare` may be cut short this way, as by a kill at the end of a grace period: it
  must be safe to run again (write to a temporary name, rename when complete).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

from spmd.comm.job_failure import announce, end_process
from spmd.errors import ExitCode
from spmd.launch.env import LaunchEnv
from spmd.launch.preemption import PreemptionWatcher

log = logging.getLogger("spmd.loop.trainer")
WAKE_S = 0.25  # how often the waiting thread looks whether training started


class EarlyStop:
    """Ends the job with ExitCode.PREEMPTED on a signal that comes before training starts."""

    def __init__(self, watcher: PreemptionWatcher, env: LaunchEnv):
        self.watcher, self.env = watcher, env
        self.on_end: list[Callable[[], None]] = []
        self.events: Any = None   # the run's EventLog once it has one: the `preempted` record
        self.phase = "start-up"   # what the rank is doing, for the line it logs
        self._lock = threading.RLock()
        self._armed = True
        self._ending = False
        self._thread: threading.Thread | None = None

    def start(self) -> EarlyStop:
        self._thread = threading.Thread(target=self._run, daemon=True, name="spmd-early-stop")
        self._thread.start()
        return self

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """A write that an early end waits for."""
        with self._lock:
            yield

    def disarm(self) -> None:
        """Training starts: from here on a signal is the stop vote's (spmd.comm.StopVote)."""
        with self._lock:
            self._armed = False
            self.on_end = []  # the trainer's own end releases them from here on

    def before_end(self, failure: Any = None) -> None:
        """Another rank ended the job (its FailureWatch calls this with its `Failure`): let
        a held write finish, record a preemption, release what `on_end` names."""
        with self._lock:
            if self._armed and getattr(failure, "kind", None) == "Preempted":
                self._record(str(failure.error))
            self._armed = False
            self._release()

    def _record(self, reason: str) -> None:
        """This rank's `preempted` record (before any step: `spmd report` names the end)."""
        if self.events is None:
            return
        try:
            self.events.record("preempted", step=None, reason=reason[:500],
                               exit_code=int(ExitCode.PREEMPTED), before_training=True)
        except Exception as e:
            log.warning("%s: could not record the preemption: %s", self.env.who, e)

    def _release(self) -> None:
        callbacks, self.on_end = self.on_end, []
        for callback in callbacks:
            try:
                callback()
            except Exception as e:  # ending anyway: the next run takes a stale lease over
                log.warning("%s: while stopping for preemption: %s", self.env.who, e)

    def _run(self) -> None:
        while not self.watcher.event.wait(WAKE_S):
            if not self._armed:
                return
        with self._lock:
            if not self._armed or self.watcher.signum is None:
                return
            self._ending = True
            name = signal.Signals(self.watcher.signum).name
            reason = (f"{name} received by {self.env.who} during {self.phase}, before the "
                      "first training step: nothing new to save; stopping for preemption "
                      f"(exit {int(ExitCode.PREEMPTED)}: requeue, and the run resumes from its "
                      "last checkpoint)")
            log.warning("%s", reason)
            self._record(reason)
            self._release()
            announce(self.env, reason, ExitCode.PREEMPTED, "Preempted")
            end_process(ExitCode.PREEMPTED, self.env)
