"""The hang watchdog: a rank whose training step does not complete in time says so, names the
ranks that did not reach the step, and the job ends with its own status (ExitCode.HUNG).

Why: a rank stuck in a collective (a stopped or dead peer, a wedged network, a deadlock)
otherwise keeps the whole allocation waiting until the wall time, saying nothing.

How:
- The loop calls `beat(step)` after every completed step. `excused(what)` brackets work that
  has its own bound (a checkpoint save: checkpoint.timeout_s and the agreements'
  launch.barrier_timeout_s): no expiry inside it, and the clock restarts after it.
- The bound is `launch.step_timeout_s`: a number of seconds, 0 for off, or None for automatic:
  max(600, 20 x the median step time), the median over the steps after `WARMUP_STEPS`.
- A daemon thread checks the clock. On expiry, this rank (1) logs one ERROR line and writes
  every thread's Python stack (faulthandler) into its log file and stderr; (2) stops watching
  its peers' exits (the lost-rank watchdog would misname what follows); (3) posts its last
  completed step under `spmd/job/hang/<rank>` in the jax.distributed key-value store; (4)
  waits `grace_s` for the other ranks' posts (every rank blocked at the same step expires at
  about the same time); (5) the first rank to claim `spmd/job/hang-report` names the ranks
  that posted nothing (stopped, or stuck outside Python) or an older step, logs the line,
  calls `on_hang(report)` (the trainer records it in run.dir) and SIGKILLs those ranks when
  they run on this host (a stopped process ends on nothing else); (6) every rank ends with
  os._exit(ExitCode.HUNG) (spmd.comm.job_failure.end_process).
- Every stuck rank is named with its host, also one that posts nothing: each rank posts its
  host once, right after bootstrap (`publish_host`, under `spmd/job/host/<rank>`), and
  `start` reads them all (one read: the build's barrier lies between), so the report names
  the hosts even when the store itself no longer answers.
- Every call to the key-value store is bounded (`KV_WAIT_S`): when rank 0's process, which
  serves it, is the stuck one, the store does not answer, and the rank says that instead.
- Rank 0 ends last (spmd.comm.job_failure.end_process), since the store ends with it.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import os
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from spmd.comm.job_failure import end_process
from spmd.comm.kvstore import bounded, kv_client
from spmd.errors import ExitCode
from spmd.launch import watchdog
from spmd.launch.env import LaunchEnv

HANG_PREFIX = "spmd/job/hang/"
HOST_PREFIX = "spmd/job/host/"   # rank -> host, posted once per job (`publish_host`)
REPORT_KEY = "spmd/job/hang-report"
AUTO_FLOOR_S = 600.0
AUTO_FACTOR = 20.0
WARMUP_STEPS = 5
KV_WAIT_S = 10.0
HUNG_FILE_NAME = "HUNG"   # run.dir/HUNG: the report, for `spmd run` and the job scripts

log = logging.getLogger("spmd.comm.hang_watchdog")


@dataclass(frozen=True)
class HangReport:
    """What the reporting rank found: the step, the silence, and who did not get there."""

    reporter: int
    step: int
    waited_s: float
    timeout_s: float
    stuck: dict[int, str] = field(default_factory=dict)   # rank -> why (no post / older step)
    hosts: dict[int, str] = field(default_factory=dict)   # rank -> host, of every rank known

    def line(self) -> str:
        if self.stuck:
            named = "; ".join(f"rank {r}{' on ' + self.hosts[r] if r in self.hosts else ''}: "
                              f"{why}" for r, why in sorted(self.stuck.items()))
            who = f"ranks that did not reach step {self.step + 1}: {named}"
        else:
            who = (f"every rank reached step {self.step} and none completed step "
                   f"{self.step + 1}: a collective or I/O of that step hangs on all of them")
        return (f"hang: no training step completed for {self.waited_s:.0f} s "
                f"(launch.step_timeout_s={self.timeout_s:g}); {who}. Every responsive rank "
                f"wrote its threads' stacks to its log; exiting with status {ExitCode.HUNG:d} "
                "(requeue and resume)")

    def to_dict(self) -> dict[str, Any]:
        return {"reporter": self.reporter, "step": self.step, "waited_s": round(self.waited_s, 1),
                "timeout_s": self.timeout_s, "stuck": {str(k): v for k, v in self.stuck.items()},
                "hosts": {str(k): v for k, v in self.hosts.items()}}


def automatic_timeout(step_times: list[float]) -> float:
    """max(600, 20 x the median of `step_times`, the step times after warm-up)."""
    if not step_times:
        return AUTO_FLOOR_S
    return max(AUTO_FLOOR_S, AUTO_FACTOR * statistics.median(step_times))


class StepWatchdog:
    """One rank's hang watchdog (see the module doc). `timeout_s`: launch.step_timeout_s."""

    def __init__(self, env: LaunchEnv, timeout_s: float | None,
                 on_hang: Callable[[HangReport], None] | None = None,
                 grace_s: float | None = None):
        self.env, self.configured, self.on_hang = env, timeout_s, on_hang
        self.grace_s = grace_s
        self.step = -1
        self._last = time.monotonic()
        self._times: list[float] = []
        self._beats = 0
        self._excused = 0
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self.hosts: dict[int, str] = {env.rank: env.hostname}  # every rank's, read by `start`

    @property
    def enabled(self) -> bool:
        return self.configured is None or self.configured > 0

    @property
    def timeout_s(self) -> float:
        if self.configured is not None:
            return float(self.configured)
        return automatic_timeout(self._times[-100:])

    def start(self, step: int) -> StepWatchdog:
        """Arm the clock at `step` (the step the loop starts from); learn every rank's host
        (`publish_host`), for a report that names the host of a rank that cannot answer."""
        if self.enabled and self.env.size > 1:
            self.hosts.update(read_hosts(KV_WAIT_S))
        self.step, self._last = step, time.monotonic()
        if self.enabled and self._thread is None:
            self._thread = threading.Thread(target=self._run, daemon=True, name="spmd-hang-watch")
            self._thread.start()
        return self

    def beat(self, step: int) -> None:
        """`step` completed on this rank."""
        now = time.monotonic()
        with self._lock:
            self._beats += 1
            if self._beats > WARMUP_STEPS:
                self._times.append(now - self._last)
                del self._times[:-1000]
            self.step, self._last = step, now

    @contextlib.contextmanager
    def excused(self) -> Iterator[None]:
        """Work with its own bound (a checkpoint save): not a hung step."""
        with self._lock:
            self._excused += 1
        try:
            yield
        finally:
            with self._lock:
                self._excused -= 1
                self._last = time.monotonic()

    def stop(self) -> None:
        self._stopped.set()

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        while not self._stopped.wait(min(1.0, max(0.05, self.timeout_s / 10))):
            with self._lock:
                waited = time.monotonic() - self._last
                if self._excused or waited < self.timeout_s:
                    continue
                step = self.step
            self._expire(step, waited)

    def _expire(self, step: int, waited: float) -> None:
        env, timeout = self.env, self.timeout_s
        log.error("%s: no training step completed for %.0f s (launch.step_timeout_s=%g); last "
                  "completed step %d. The stacks of all this rank's threads follow", env.who,
                  waited, timeout, step)
        dump_stacks()
        watchdog.disarm_peers()
        report = self._report(step, waited, timeout)
        if report is not None:
            log.error("%s", report.line())
            if self.on_hang is not None:
                try:
                    self.on_hang(report)
                except Exception as e:  # recording it must not keep the job alive
                    log.error("recording the hang failed: %s", e)
            kill_local(report.stuck, env)
        end_process(ExitCode.HUNG, env)

    def _report(self, step: int, waited: float, timeout: float) -> HangReport | None:
        """Post, wait, and (first rank only) the report; None when another rank made it."""
        env, hosts = self.env, dict(self.hosts)
        me = HangReport(env.rank, step, waited, timeout, hosts=hosts)
        client = kv_client() if env.size > 1 else None
        if client is None:
            return me
        posted = bounded(lambda: client.key_value_set(
            f"{HANG_PREFIX}{env.rank}", json.dumps({"step": step, "host": env.hostname})),
            KV_WAIT_S)
        if not posted.ok:
            return HangReport(env.rank, step, waited, timeout, stuck={
                0: "the jax.distributed coordination service it serves does not answer "
                   f"({posted.error})"}, hosts=hosts)
        grace = self.grace_s if self.grace_s is not None else min(30.0, max(5.0, timeout / 4))
        self._stopped.wait(grace)
        listed = bounded(lambda: client.key_value_dir_get(HANG_PREFIX), KV_WAIT_S)
        if not listed.ok:
            return HangReport(env.rank, step, waited, timeout, stuck={
                0: f"the jax.distributed coordination service does not answer ({listed.error})"},
                hosts=hosts)
        posts = {int(k.rsplit("/", 1)[-1]): json.loads(v) for k, v in listed.value}
        newest = max(p["step"] for p in posts.values())
        stuck = {r: "no answer (stopped, dead, or stuck outside Python)"
                 for r in range(env.size) if r not in posts}
        stuck.update({r: f"last completed step {p['step']}" for r, p in posts.items()
                      if p["step"] < newest})
        hosts.update({r: p["host"] for r, p in posts.items()})
        if any(r not in hosts for r in stuck):  # `start` could not read them all
            hosts = {**read_hosts(KV_WAIT_S), **hosts}
        report = HangReport(env.rank, newest, waited, timeout, stuck, hosts)
        claimed = bounded(lambda: client.key_value_set(REPORT_KEY, json.dumps(report.to_dict())),
                          KV_WAIT_S)
        return report if claimed.ok else None  # not ok: another rank reports it


def publish_host(env: LaunchEnv) -> bool:
    """Post this rank's host under `spmd/job/host/<rank>` (once per job, right after
    bootstrap): a hang report then names the host of a rank that cannot answer. False when
    there is no store (one process) or it did not take the post."""
    client = kv_client() if env.size > 1 else None
    if client is None:
        return False
    return bounded(lambda: client.key_value_set(f"{HOST_PREFIX}{env.rank}", env.hostname),
                   KV_WAIT_S).ok


def read_hosts(timeout_s: float) -> dict[int, str]:
    """{rank: host} of the ranks that posted theirs (`publish_host`); {} when the store does
    not answer within `timeout_s`."""
    client = kv_client()
    if client is None:
        return {}
    listed = bounded(lambda: client.key_value_dir_get(HOST_PREFIX), timeout_s)
    if not listed.ok:
        return {}
    return {int(k.rsplit("/", 1)[-1]): str(v) for k, v in listed.value}


def dump_stacks() -> None:
    """Every thread's Python stack into this rank's log files and stderr (faulthandler)."""
    targets = []
    for handler in logging.getLogger().handlers:
        stream = getattr(handler, "stream", None)
        if isinstance(handler, logging.FileHandler) and stream is not None:
            targets.append(stream)
    targets.append(sys.stderr)
    for stream in targets:
        try:
            stream.flush()
            faulthandler.dump_traceback(file=stream, all_threads=True)
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass


def kill_local(stuck: dict[int, str], env: LaunchEnv) -> list[int]:
    """SIGKILL the stuck ranks that run on this host (pids learned at bootstrap); returns
    the ranks killed."""
    killed = []
    for rank, (pid, start) in watchdog.local_peers().items():
        if rank in stuck and rank != env.rank and watchdog.process_alive(pid, start):
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(rank)
                log.error("%s: killed rank %d (pid %d on %s): it did not reach the step",
                          env.who, rank, pid, env.hostname)
            except OSError:
                pass
    return killed
