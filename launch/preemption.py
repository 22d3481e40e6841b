"""Preemption: signals, a halt file or the wall-time deadline become one flag all ranks share.

`PreemptionWatcher.should_stop(step)` is a collective every rank calls at every step
boundary; it returns True on all ranks at the same step when any rank received one of the
watched signals (SIGTERM, SIGUSR1, SIGUSR2 by default), rank 0 sees the halt file, or the
`deadline` (epoch seconds, set on any rank) has passed. The agreement is an MPI allreduce
when the job runs under MPI, else the jax.distributed key-value store and a barrier; both
time out (LaunchError) instead of hanging when a rank is gone.

The trainer saves and exits with `spmd.errors.ExitCode.PREEMPTED` (75, EX_TEMPFAIL);
job scripts turn that status into a requeue.

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

import numpy as np

from spmd.comm.kvstore import kv_client
from spmd.launch import mpi
from spmd.launch.env import LaunchEnv, resolve_launch_env
from spmd.launch.errors import LaunchError

# The halt file in run.dir: present -> all ranks stop at the next step (job scripts write it).
HALT_FILE_NAME = "HALT"
DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
_DEADLINE, _HALT, _SIGNAL = 1, 2, 3  # the highest kind any rank saw names the reason
_KIND, _SIG = 1 << 40, 1 << 32


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
    """Collects stop requests on this rank; `should_stop` makes all ranks agree on them."""

    def __init__(self, env: LaunchEnv, comm: Any, halt_file: Path | None, timeout_s: float):
        self.env, self.comm, self.timeout_s = env, comm, timeout_s
        self.halt_file = Path(halt_file) if halt_file is not None else None
        self.deadline: float | None = None
        self.reason: str | None = None
        self.stop_step: int | None = None
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}
        self._calls = 0

    @classmethod
    def install(cls, signals: Iterable[int] = DEFAULT_SIGNALS, halt_file: Path | None = None,
                *, timeout_s: float = 300.0, env: LaunchEnv | None = None) -> PreemptionWatcher:
        """Watch `signals` and `halt_file` on this rank (uses the last bootstrap's env)."""
        from spmd.launch.startup import current

        boot = current()
        comm = boot[1] if boot and env is None else None
        env = env or (boot[0] if boot else resolve_launch_env())
        if comm is not None and comm.Get_size() != env.size:
            comm = None
        watcher = cls(env, comm, halt_file, timeout_s)
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

    def _local(self) -> tuple[int, str]:
        """(code, reason) of what this rank saw; code 0 = nothing."""
        where = f"rank {self.env.rank} on {self.env.hostname}"
        if self.signum is not None:
            name = signal.Signals(self.signum).name
            code = _SIGNAL * _KIND + self.signum * _SIG + self.env.rank
            return code, f"{name} received by {where}"
        if self.env.rank == 0 and self.halt_file is not None and self.halt_file.exists():
            return _HALT * _KIND + self.env.rank, f"halt file {self.halt_file} found by {where}"
        if self.deadline is not None and time.time() >= self.deadline:
            return (_DEADLINE * _KIND + self.env.rank,
                    f"wall-time deadline {time.ctime(self.deadline)} passed ({where})")
        return 0, ""

    def should_stop(self, step: int) -> bool:
        """Collective: True on every rank at the same step once any rank has a reason."""
        if self.stop_step is not None:
            return True
        code, text = self._local()
        self._calls += 1
        if self.env.size > 1:
            code, text = self._agree(step, code, text)
        if code:
            self.stop_step, self.reason = step, text
        return bool(code)

    def _agree(self, step: int, code: int, text: str) -> tuple[int, str]:
        what = f"agree whether to stop at step {step}"
        if self.comm is not None:
            out = mpi.allreduce_max(self.comm, np.array([code, step, -step]), self.timeout_s,
                                    self.env.who, what)
            self._check_steps(int(-out[2]), int(out[1]))
            code = int(out[0])
            if code:
                text = mpi.bcast_str(self.comm, text, code % _SIG, self.timeout_s, self.env.who,
                                     "share the stop reason")
            return code, text
        client = kv_client()
        if client is None:
            raise LaunchError(f"{self.env.who}: PreemptionWatcher needs MPI or an initialized "
                              f"jax.distributed for {self.env.size} ranks; call bootstrap() first")
        prefix = f"spmd/preempt/{self._calls}"
        try:
            client.key_value_set(f"{prefix}/{self.env.rank}", f"{code} {step} {text}")
            # One reused barrier id (jax keeps a counter per id), so nothing grows per step.
            client.wait_at_barrier("spmd/preempt", int(self.timeout_s * 1000))
            entries = [v.split(" ", 2) for _, v in client.key_value_dir_get(f"{prefix}/")]
            client.key_value_delete(f"spmd/preempt/{self._calls - 1}/{self.env.rank}")
        except Exception as e:  # the client raises its own runtime error type
            raise LaunchError(f"{self.env.who}: could not {what} with all {self.env.size} ranks "
                              f"within {self.timeout_s:.0f} s over jax.distributed: "
                              f"{str(e).strip().splitlines()[0]}") from e
        steps = [int(e[1]) for e in entries]
        self._check_steps(min(steps), max(steps))
        best = max(entries, key=lambda e: int(e[0]))
        return int(best[0]), best[2] if len(best) > 2 else ""

    def _check_steps(self, low: int, high: int) -> None:
        if low != high:
            raise LaunchError(f"{self.env.who}: ranks checked for preemption at different steps "
                              f"({low}..{high}); every rank must call should_stop at every step")

