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

Once the interpreter exits, the watched signals are ignored (`ignore_at_exit`, also called
by `bootstrap` for every rank under MPI; its atexit handler runs before MPI_Finalize's):
Hydra's `-disable-auto-cleanup` sends SIGUSR1 to every rank as each one closes its PMI
socket, and after Python's own handlers are gone that would kill a rank that has finished
cleanly.
"""

from __future__ import annotations

import atexit
import signal
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

    def __init__(self, env: LaunchEnv, halt_file: Path | None):
        self.env = env
        self.halt_file = Path(halt_file) if halt_file is not None else None
        self.deadline: float | None = None
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    @classmethod
    def install(cls, signals: Iterable[int] = DEFAULT_SIGNALS, halt_file: Path | None = None,
                *, env: LaunchEnv | None = None) -> PreemptionWatcher:
        """Watch `signals` and `halt_file` on this rank (`env`: this rank's, else resolved)."""
        watcher = cls(env or resolve_launch_env(), halt_file)
        for s in signals:
            watcher._previous[s] = signal.signal(s, watcher._on_signal)
        ignore_at_exit(signals)
        return watcher

    def uninstall(self) -> None:
        """Restore the signal handlers that were there before `install`."""
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.signum is None:  # the first one names the reason; only set a flag here
            self.signum = signum

    def request(self) -> tuple[int, str]:
        """(priority, reason) of the stop this rank asks for now; priority 0: none."""
        where = f"rank {self.env.rank} on {self.env.hostname}"
        if self.signum is not None:
            name = signal.Signals(self.signum).name
            return SIGNAL << 8 | self.signum, f"{name} received by {where}"
        if self.env.rank == 0 and self.halt_file is not None and self.halt_file.exists():
            return HALT << 8, f"halt file {self.halt_file} found by {where}"
        if self.deadline is not None and time.time() >= self.deadline:
            return DEADLINE << 8, f"wall-time deadline {time.ctime(self.deadline)} passed ({where})"
        return 0, ""
