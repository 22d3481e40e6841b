"""`bootstrap`: resolve this rank, bind its devices, pick the coordinator, start jax.distributed.

jax.distributed.initialize aborts the whole process from C++ when the coordinator does not
answer in time (jax 0.10: "Terminating process because the JAX distributed service detected
fatal errors ... DEADLINE_EXCEEDED"), so every wait is ours first: non-zero ranks probe the
coordinator's TCP port until `init_timeout_s`, and a watchdog thread ends the process with a
message naming rank, host and coordinator if initialize itself is not done by then.

Preemption is watched from bootstrap's first line on (spmd.launch.preemption): the process's
`PreemptionWatcher` is installed before MPI or jax.distributed start, JAX's own preemption
notifier is turned off (`jax_enable_preemption_service`: its C++ handler caught SIGTERM,
"preemption_notifier.cc: SIGTERM caught", and the signal was lost to spmd), and the watcher's
handlers are put back after jax.distributed.initialize, in case anything replaced them.

Nothing else reads bootstrap's state: other layers get the LaunchEnv it returns, and the MPI
world from `spmd.launch.mpi.world()` (cached: the same communicator bootstrap used).
"""

from __future__ import annotations

import inspect
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from spmd.errors import ExitCode
from spmd.launch import coordinator, devices, mpi, watchdog
from spmd.launch.env import LaunchEnv, resolve_launch_env
from spmd.launch.errors import LaunchError
from spmd.launch.preemption import PreemptionWatcher, ignore_at_exit

_booted: list[LaunchEnv] = []  # the first bootstrap's env: jax.distributed starts once


def _timed_out(env: LaunchEnv, addr: str, timeout_s: float) -> None:
    waited_for = ("for all ranks to connect to the coordinator it serves" if env.rank == 0 else
                  "for all ranks to join (this rank reached the coordinator)")
    print(f"spmd: error: {env.who}: jax.distributed.initialize did not finish within "
          f"{timeout_s:.0f} s, waiting {waited_for} at {addr} ({env.size} ranks, "
          f"launcher {env.launcher}). Check that every rank started (launcher output, their "
          f"logs), that {addr} is reachable from every node, or raise launch.init_timeout_s",
          file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(ExitCode.USER_ERROR)


def _initialize(env: LaunchEnv, ids: tuple[int, ...] | None, init_timeout_s: float,
                heartbeat_timeout_s: float, shutdown_timeout_s: float,
                watch_preemption: bool = False) -> None:
    import jax

    assert env.coordinator is not None
    start = time.monotonic()
    if env.rank != 0:
        coordinator.wait_reachable(env.coordinator, init_timeout_s, env.who)
    left = max(1.0, init_timeout_s - (time.monotonic() - start))
    wanted = dict(
        coordinator_address=env.coordinator, num_processes=env.size, process_id=env.rank,
        local_device_ids=list(ids) if ids is not None else None,
        cluster_detection_method="deactivate",
        initialization_timeout=int(math.ceil(left)) + 60,  # our watchdog speaks first
        heartbeat_timeout_seconds=int(math.ceil(heartbeat_timeout_s)),
        shutdown_timeout_seconds=int(math.ceil(shutdown_timeout_s)))
    accepted = inspect.signature(jax.distributed.initialize).parameters
    kwargs = {k: v for k, v in wanted.items() if k in accepted}
    watchdog = threading.Timer(left, _timed_out, args=(env, env.coordinator, init_timeout_s))
    watchdog.daemon = True
    watchdog.start()
    _no_jax_preemption_notifier(jax)
    try:
        jax.distributed.initialize(**kwargs)
    except (RuntimeError, ValueError) as e:
        raise LaunchError(f"{env.who}: jax.distributed.initialize({env.coordinator}, "
                          f"{env.size} processes) failed: {e}") from e
    finally:
        watchdog.cancel()
        if watch_preemption:  # whatever initialize did to the handlers, spmd's are back
            _watch_preemption(env)


def _no_jax_preemption_notifier(jax: Any) -> None:
    """Turn off JAX's preemption service: its notifier takes SIGTERM for itself (spmd's
    watcher decides what a signal means; nothing of spmd uses JAX's sync points)."""
    try:
        jax.config.update("jax_enable_preemption_service", False)
    except (AttributeError, KeyError, ValueError):
        pass  # a JAX without that option has no notifier to turn off


def _watch_preemption(env: LaunchEnv | None) -> PreemptionWatcher | None:
    """Install (or put back) the process's preemption watcher; main thread only."""
    if threading.current_thread() is threading.main_thread():
        return PreemptionWatcher.install(env=env)
    return None


class _StopWhileStarting:
    """A preemption signal while bootstrap runs ends this rank at once with status 75.

    Until jax.distributed is up no rank can tell the others (spmd.comm.job_failure needs
    its key-value store), and bootstrap may wait minutes for its peers (MPI_Init, the
    coordinator, initialize): a peer that died of the same signal before it could catch it
    would keep this one waiting until launch.init_timeout_s. Nothing exists to save yet, so
    this rank ends (the others got the same signal from the scheduler or `spmd run`; one
    that did not fails its own wait, naming this rank). After `done()`, the trainer's
    early stop (spmd.loop.early_stop) acts on the signal instead, for every rank.
    """

    def __init__(self, watcher: PreemptionWatcher):
        self.watcher, self.who = watcher, f"this rank (pid {os.getpid()})"
        self._lock = threading.Lock()
        self._done = False
        threading.Thread(target=self._run, daemon=True, name="spmd-start-stop").start()

    def done(self) -> None:
        with self._lock:
            self._done = True

    def _run(self) -> None:
        while not self.watcher.event.wait(0.25):
            if self._done:
                return
        with self._lock:
            if self._done or self.watcher.signum is None:
                return
            name = signal.Signals(self.watcher.signum).name
            print(f"spmd: {self.who}: {name} received while starting (before jax.distributed "
                  f"was up): nothing to save; exiting {int(ExitCode.PREEMPTED)} (preempted: "
                  "requeue, and the run resumes from its last checkpoint)", file=sys.stderr,
                  flush=True)
            watchdog.leave_exit_mark()  # ended on its own: its peers must not name it lost
            os._exit(ExitCode.PREEMPTED)


def bootstrap(init_timeout_s: float = 300.0, heartbeat_timeout_s: float = 100.0, *,
              shutdown_timeout_s: float | None = None,
              environ: Mapping[str, str] | None = None,
              watch_preemption: bool = False) -> LaunchEnv:
    """Resolve, bind devices and (for more than one rank) jax.distributed.initialize.

    `watch_preemption` (training): the process's PreemptionWatcher is installed first, so
    that SIGTERM, SIGUSR1 and SIGUSR2 are recorded, not fatal, from here on; without it a
    signal keeps its default action. Idempotent: a second call in the same process returns
    the first call's LaunchEnv.
    """
    if _booted:  # once per process: jax.distributed cannot be initialized twice
        return _booted[0]
    watcher = _watch_preemption(None) if watch_preemption else None  # first of all
    starting = _StopWhileStarting(watcher) if watcher is not None else None
    try:
        environ = os.environ if environ is None else environ
        comm = mpi.world(environ)
        if comm is not None:  # after MPI_Init: a peer's exit must not kill this rank at its own
            ignore_at_exit()
        env = resolve_launch_env(environ, comm, timeout_s=init_timeout_s)
        watchdog.watch_launcher(environ, env.who)  # `spmd run` gone -> this rank ends (<= 1 s)
        device_plan = devices.plan(env, environ)
        addr, source = coordinator.choose(env, comm, environ, init_timeout_s)
        env = replace(env, coordinator=addr, sources={**env.sources, "coordinator": source})
        devices.apply(device_plan, environ)
        if watch_preemption:
            _watch_preemption(env)  # the watcher names this rank from here on
        if starting is not None:
            starting.who = env.who
        if comm is not None and env.size > 1 and comm.Get_size() == env.size:
            _watch_local_peers(env, comm, init_timeout_s)
        if env.size > 1:
            _initialize(env, device_plan.local_device_ids, init_timeout_s, heartbeat_timeout_s,
                        shutdown_timeout_s or init_timeout_s, watch_preemption)
    finally:  # from here on the trainer tells every rank (its early stop)
        if starting is not None:
            starting.done()
    _booted.append(env)
    return env


def _watch_local_peers(env: LaunchEnv, comm: Any, timeout_s: float) -> None:
    """Learn (host, pid, start time) of every rank; watch the other ranks on this host."""
    me = f"{env.hostname} {os.getpid()} {watchdog.process_start_time(os.getpid()) or ''}"
    entries = mpi.allgather_str(comm, me, timeout_s, env.who, "exchange process ids")
    peers = {}
    for rank, entry in enumerate(entries):
        host, pid, start = (entry.split(" ") + ["", "", ""])[:3]
        if rank != env.rank and host == env.hostname and pid.isdigit():
            peers[rank] = (int(pid), int(start) if start.isdigit() else None)
    if peers:
        job_key = "-".join(entries[0].split(" ")).replace("/", "_")  # rank 0's host-pid-start
        watchdog.watch_peers(peers, env.rank, env.hostname, env.who, job_key)


def shutdown() -> None:
    """Stop watching peers, then jax.distributed.shutdown (a barrier of all ranks)."""
    import jax

    watchdog.disarm_peers()
    jax.distributed.shutdown()
