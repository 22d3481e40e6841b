"""Preemption as one rank sees it: watched signals, the halt file, the wall-time deadline.

`PreemptionWatcher.install()` watches SIGTERM, SIGUSR1 and SIGUSR2 (by default) on this rank;
`request()` says whether this rank wants the run to stop, and why. Nothing here talks to
other ranks: making all ranks stop at the same step, for the same reason, is
`spmd.comm.stop_vote.StopVote`, one layer up.

Invariants
- A signal handler only records the first signal's number; everything else happens at the
  next step boundary, in `request()`.
- Only rank 0 looks at the halt file (one stat per step for the whole job); the deadline is
  looked at on every rank that has one.
- `request()`'s priority orders the kinds: any signal (the higher number first) over the
  halt file over the deadline; 0 means no request.

One watcher per process, from bootstrap's first line to the process's end: `install()`
returns the process's watcher when there is one (a signal it recorded before the trainer's
hooks asked for it is kept), and `reinstall()` puts its handlers back after a library that
replaced them (bootstrap calls it right after jax.distributed.initialize, whose preemption
notifier it also turns off: that notifier caught SIGTERM and the signal was lost). `event`
is set on the first signal, for a thread that acts on it before training starts
(spmd.loop.early_stop). A handler it replaces that has a `received` signal number (the CLI's
`spmd.cli.early_signal`, from the process's first moment) hands that signal over.

Once the interpreter exits, the watched signals are ignored (`ignore_at_exit`, also called
by `bootstrap` for every rank under MPI; its atexit handler runs before MPI_Finalize's):
Hydra's `-disable-auto-cleanup` sends SIGUSR1 to every rank as each one closes its PMI
socket, and after Python's own handlers are gone that would kill a rank that has finished
cleanly.
"""

from __future__ import annotations

import atexit
import signal
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from spmd.launch.env import LaunchEnv, resolve_launch_env

# The halt file in run.dir: present -> all ranks stop at the next step (job scripts write it).
HALT_FILE_NAME = "HALT"
DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
DEADLINE, HALT, SIGNAL = 1, 2, 3  # kinds of request; priority = kind << 8 | signal number


_IGNORED_AT_EXIT: set[int] = set()
_PROCESS: list[PreemptionWatcher] = []  # the process's watcher, once installed


def _ignore_now() -> None:
    for s in _IGNORED_AT_EXIT:
        signal.signal(s, signal.SIG_IGN)


def ignore_at_exit(signals: Iterable[int] = DEFAULT_SIGNALS) -> None:
    """Ignore `signals` once the interpreter exits. Call it after MPI is initialized: atexit
    runs handlers last-in first-out, so this one then runs before mpi4py's MPI_Finalize."""
    if not _IGNORED_AT_EXIT:
        atexit.register(_ignore_now)
    _IGNORED_AT_EXIT.update(signals)


class PreemptionWatcher:
    """Collects the stop requests that reach this rank (signals, halt file, deadline)."""

    def __init__(self, env: LaunchEnv | None, halt_file: Path | None):
        self.env = env  # None until bootstrap has resolved this rank (set then)
        self.halt_file = Path(halt_file) if halt_file is not None else None
        self.deadline: float | None = None
        self.signum: int | None = None
        self.event = threading.Event()  # set with `signum`, for a waiting thread
        self._previous: dict[int, Any] = {}

    @classmethod
    def install(cls, signals: Iterable[int] = DEFAULT_SIGNALS, halt_file: Path | None = None,
                *, env: LaunchEnv | None = None) -> PreemptionWatcher:
        """Watch `signals` and `halt_file` on this rank (`env`: this rank's, else resolved).

        The process's watcher, if one is installed already, is kept (with what it saw) and
        given `halt_file` and `env`; its handlers are put back (`reinstall`)."""
        if _PROCESS:
            watcher = _PROCESS[0]
            if halt_file is not None:
                watcher.halt_file = Path(halt_file)
            if env is not None:
                watcher.env = env
        else:
            watcher = cls(env, halt_file)
            _PROCESS.append(watcher)
        watcher.reinstall(signals)
        return watcher

    @classmethod
    def current(cls) -> PreemptionWatcher | None:
        """The process's watcher, if installed."""
        return _PROCESS[0] if _PROCESS else None

    def reinstall(self, signals: Iterable[int] = DEFAULT_SIGNALS) -> None:
        """Make this watcher the handler of `signals` again (main thread only)."""
        for s in signals:
            previous = signal.signal(s, self._on_signal)
            if previous != self._on_signal:
                self._previous.setdefault(s, previous)
                # a handler that recorded a signal before this one (spmd.cli.early_signal)
                early = getattr(previous, "received", None)
                if isinstance(early, int) and self.signum is None:
                    self._on_signal(early, None)
        ignore_at_exit(signals)

    def uninstall(self) -> None:
        """Restore the signal handlers that were there before `install`; the process has
        no watcher after this (a later `install` starts afresh)."""
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()
        if _PROCESS and _PROCESS[0] is self:
            _PROCESS.clear()

    def reset(self) -> None:
        """Forget the signal seen (a run in this process ended; the next one starts clean)."""
        self.signum = None
        self.event.clear()

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.signum is None:  # the first one names the reason; only set a flag here
            self.signum = signum
            self.event.set()

    def request(self) -> tuple[int, str]:
        """(priority, reason) of the stop this rank asks for now; priority 0: none."""
        if self.env is None:
            self.env = resolve_launch_env()
        where = f"rank {self.env.rank} on {self.env.hostname}"
        if self.signum is not None:
            name = signal.Signals(self.signum).name
            return SIGNAL << 8 | self.signum, f"{name} received by {where}"
        if self.env.rank == 0 and self.halt_file is not None and self.halt_file.exists():
            return HALT << 8, f"halt file {self.halt_file} found by {where}"
        if self.deadline is not None and time.time() >= self.deadline:
            return DEADLINE << 8, f"wall-time deadline {time.ctime(self.deadline)} passed ({where})"
        return 0, ""
