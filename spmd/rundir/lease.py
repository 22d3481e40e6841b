"""One writer per run directory: rank 0 holds `run.dir/lease.json` while a run writes there.

Invariants
- At most one live lease per run directory. Rank 0 takes it before anything of the run is
  written there (config.yaml, logs, events, metrics, checkpoints), and every rank learns rank
  0's decision (`spmd.comm.RankGroup`: MPI, else the jax.distributed key-value store, within
  launch.barrier_timeout_s): a refused run ends on all ranks with status 2, and only rank 0
  prints the one line that names the holder.
- Creation is an atomic link(2) of a fully written, fsynced temp file onto LEASE_NAME, which
  fails when the name exists; a reader never sees a partial lease. No flock: link and rename
  are atomic on local file systems, NFS (with the usual st_nlink check when link's reply is
  lost), Lustre and GPFS.
- The lease file's mtime is the heartbeat: a thread of the holder touches it every
  `heartbeat_s` (lease_stale_s / 5, at most 30 s), after checking it still carries the
  holder's token. Heartbeat ages compare the file server's mtime with this host's clock:
  clocks must agree to well within `run.lease_stale_s`.
- A lease is stale when its holder is provably dead: on this host, its pid is gone, a zombie,
  or another process (start time differs); or it is the same job id with a lower restart count
  (a requeued Slurm job). A holder on another host is stale only when its heartbeat is older
  than `run.lease_stale_s`. A stale lease is taken over at once by rename(2) of our own record
  over it (atomic replace), then read back; the take-over is logged and emitted as the event
  `lease_taken_over` naming the previous holder.
- Released (unlinked, if it still carries our token) whenever `train()` returns or raises:
  a clean finish, a preemption (status 75), an error. Not when the process is killed or its
  launcher watchdog ends it: the next run takes the stale lease over.
- A holder whose heartbeat finds the lease gone or another token in it stops the process at
  once (status ExitCode.LEASE_LOST, 73) with a line naming the new holder, writing nothing more.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from spmd.comm.rank_group import RankGroup
from spmd.errors import ExitCode, SpmdError
from spmd.launch import LaunchEnv, liveness
from spmd.launch.env import job_identity
from spmd.launch.watchdog import launcher_from, process_alive, process_start_time

log = logging.getLogger("spmd.rundir.lease")

LEASE_NAME = "lease.json"


class LeaseHeld(SpmdError):
    """Another live run holds the run directory's lease."""


class RunDirError(SpmdError):
    """run.dir cannot hold a run: it is a file, or it cannot be created or written."""


def unusable_run_dir(run_dir: Path, error: OSError) -> RunDirError:
    """The one-line error for an OSError met while creating or writing in `run_dir`."""
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        what = "is a file, not a directory"
    else:
        blocker = next((p for p in run_dir.parents if p.exists() and not p.is_dir()), None)
        what = (f"cannot be created: {blocker} is a file" if blocker is not None else
                f"cannot be written ({error.strerror or error}: {error.filename or run_dir})")
    return RunDirError(f"run.dir={run_dir} {what}; point run.dir at a directory this user "
                       f"can write (nothing of the run was written)")


@dataclass(frozen=True)
class Holder:
    """Who holds (or wants) a lease; written as the lease file's JSON."""

    token: str
    host: str
    pid: int
    pid_start: int | None
    job_id: str | None
    restart_count: int
    launcher: str
    launcher_pid: int | None
    started: float

    @classmethod
    def me(cls, launcher: str, job_id: str | None, restart_count: int,
           environ: Mapping[str, str] | None = None) -> Holder:
        parent = launcher_from(os.environ if environ is None else environ)
        return cls(uuid.uuid4().hex, socket.gethostname(), os.getpid(),
                   process_start_time(os.getpid()), job_id, restart_count, launcher,
                   parent[0] if parent else None, time.time())

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Holder:
        return cls(str(d.get("token", "?")), str(d.get("host", "?")), int(d.get("pid", 0)),
                   d.get("pid_start"), d.get("job_id"), int(d.get("restart_count", 0)),
                   str(d.get("launcher", "?")), d.get("launcher_pid"),
                   float(d.get("started", 0.0)))

    def describe(self) -> str:
        job = f"job {self.job_id} (restart {self.restart_count})" if self.job_id else "no job id"
        via = f"{self.launcher}" + (f", spmd run pid {self.launcher_pid}"
                                    if self.launcher_pid else "")
        return (f"pid {self.pid} on {self.host}, {job}, launcher {via}, since "
                f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.started))}")


@dataclass(frozen=True)
class LeaseState:
    """A lease as an observer sees it (`spmd ckpt ls`, `spmd run`)."""

    holder: Holder
    heartbeat_age_s: float
    stale: bool
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "holder": asdict(self.holder)}

    def describe(self, stale_s: float) -> str:
        state = f"stale: {self.reason}" if self.stale else f"live: {self.reason}"
        return (f"held by {self.holder.describe()}; heartbeat {self.heartbeat_age_s:.0f} s ago "
                f"({state}; run.lease_stale_s={stale_s:g})")


def read_lease(path: Path) -> tuple[Holder, float] | None:
    """(holder, heartbeat mtime) of the lease file at `path`, or None when there is none."""
    try:
        with open(path) as fh:
            mtime = os.fstat(fh.fileno()).st_mtime
            text = fh.read()
    except FileNotFoundError:
        return None
    try:
        return Holder.from_dict(json.loads(text)), mtime
    except (ValueError, TypeError, AttributeError):  # not ours, or damaged: judge by age only
        return Holder("?", "?", 0, None, None, 0, "?", None, mtime), mtime


def judge(holder: Holder, mtime: float, *, host: str, job_id: str | None, restart_count: int,
          stale_s: float, now: float | None = None) -> tuple[bool, str]:
    """(stale, why) of a lease held by `holder`, seen from `host` in job `job_id`."""
    age = (time.time() if now is None else now) - mtime
    if holder.job_id and holder.job_id == job_id and restart_count > holder.restart_count:
        return True, (f"the same job {job_id} was requeued (restart {restart_count} > "
                      f"{holder.restart_count})")
    if holder.host == host:
        if process_alive(holder.pid, holder.pid_start):
            return False, f"pid {holder.pid} is running on this host"
        return True, f"pid {holder.pid} is no longer running on {host}"
    if age > stale_s:
        return True, f"no heartbeat for {age:.0f} s > run.lease_stale_s={stale_s:g}"
    return False, f"heartbeat {age:.0f} s ago from {holder.host}"


def inspect_lease(run_dir: Path, stale_s: float,
                  environ: Mapping[str, str] | None = None) -> LeaseState | None:
    """The lease of `run_dir` as seen from this process (None when no run holds it)."""
    try:
        got = read_lease(Path(run_dir) / LEASE_NAME)
    except OSError as e:
        raise unusable_run_dir(run_dir, e) from None
    if got is None:
        return None
    holder, mtime = got
    job_id, restarts = job_identity(os.environ if environ is None else environ)
    now = time.time()
    stale, why = judge(holder, mtime, host=socket.gethostname(), job_id=job_id,
                       restart_count=restarts, stale_s=stale_s, now=now)
    return LeaseState(holder, max(0.0, now - mtime), stale, why)


def refusal(path: Path, holder: Holder, mtime: float, stale_s: float) -> str:
    return (f"run directory {path.parent} is in use by another run: its lease {path} is held by "
            f"{holder.describe()}, last heartbeat {max(0.0, time.time() - mtime):.0f} s ago. "
            "Stop that run or choose another run.dir (a lease is taken over when its holder is "
            f"dead, or after run.lease_stale_s={stale_s:g} s without a heartbeat from another "
            "host)")


def _write_temp(path: Path, me: Holder) -> Path:
    tmp = path.with_name(f".{path.name}.{me.host}.{me.pid}.{uuid.uuid4().hex[:8]}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, (json.dumps(asdict(me), indent=1) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    return tmp


def _link(tmp: Path, path: Path) -> bool:
    """Atomically create `path` as a second name of `tmp`; False when `path` exists."""
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    except OSError:
        # NFS: a retried LINK whose first reply was lost reports an error although it worked.
        if os.stat(tmp).st_nlink == 2:
            return True
        raise


def take(run_dir: Path, me: Holder, stale_s: float) -> tuple[Holder, str] | None:
    """Take the lease of `run_dir` for `me`: None when it was free, else (previous, why).

    Raises LeaseHeld naming the holder when a live run holds it.
    """
    path = Path(run_dir) / LEASE_NAME
    for _ in range(20):
        tmp = _write_temp(path, me)
        try:
            if _link(tmp, path):
                return None
            got = read_lease(path)
            if got is None:
                continue  # released between our link and our read: try again
            holder, mtime = got
            stale, why = judge(holder, mtime, host=me.host, job_id=me.job_id,
                               restart_count=me.restart_count, stale_s=stale_s)
            if not stale:
                raise LeaseHeld(refusal(path, holder, mtime, stale_s))
            os.rename(tmp, path)  # atomic replace; a racing taker's rename may follow ours
            mine = read_lease(path)
            if mine is not None and mine[0].token == me.token:
                return holder, why
        finally:
            tmp.unlink(missing_ok=True)
    raise LeaseHeld(f"could not take the lease {path}: other runs kept taking it; check who "
                    "writes into this run directory")


class RunLease:
    """This rank's part of the lease: rank 0 holds it, other ranks only follow the decision."""

    def __init__(self, run_dir: Path, env: LaunchEnv, me: Holder | None,
                 previous: tuple[Holder, str] | None, stale_s: float):
        self.path = Path(run_dir) / LEASE_NAME
        self.env, self.me, self.previous, self.stale_s = env, me, previous, stale_s
        self.heartbeat_s = min(30.0, stale_s / 5)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def acquire(cls, run_dir: Path, env: LaunchEnv, stale_s: float = 300.0,
                timeout_s: float = 300.0) -> RunLease:
        """Collective (every rank): rank 0 takes the lease; all ranks exit 2 when refused."""
        run_dir = Path(run_dir)
        me, previous, decision, error = None, None, "ok", None
        if env.rank == 0:
            me = Holder.me(env.launcher, env.job_id, env.restart_count)
            try:
                run_dir.mkdir(parents=True, exist_ok=True)
                previous = take(run_dir, me, stale_s)
            except OSError as e:
                decision, error = "refused", unusable_run_dir(run_dir, e)
            except BaseException as e:  # every rank must hear of it, whatever it is
                decision, error = "refused", e
        group = RankGroup(env, timeout_s, "launch.barrier_timeout_s", "lease")
        decision = group.broadcast_str(decision, 0, "learn whether rank 0 got the run "
                                       "directory's lease")
        if error is not None:
            raise error
        if decision != "ok":  # rank 0 prints the one line that names the holder
            log.debug("rank 0 did not get the lease of %s; exiting", run_dir)
            raise SystemExit(ExitCode.USER_ERROR)
        return cls(run_dir, env, me, previous, stale_s)

    def start(self, events: Any) -> None:
        """Log how the lease was taken (rank 0) and start the heartbeat thread."""
        if self.me is None:
            return
        if self.previous is not None:
            old, why = self.previous
            log.warning("took over the lease %s from %s: %s", self.path, old.describe(), why)
            events.emit("lease_taken_over", path=str(self.path), reason=why,
                        previous=asdict(old), holder=asdict(self.me))
        else:
            events.emit("lease_acquired", path=str(self.path), holder=asdict(self.me))
        self._thread = threading.Thread(target=self._beat, name="spmd-lease-heartbeat",
                                        daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        assert self.me is not None
        while not self._stop.wait(self.heartbeat_s):
            got = read_lease(self.path)
            if got is None or got[0].token != self.me.token:
                new = "it was removed" if got is None else f"now held by {got[0].describe()}"
                print(f"spmd: error: {self.env.who}: lost the lease on {self.path.parent} "
                      f"({new}); stopping with status {ExitCode.LEASE_LOST:d} without writing "
                      "more: another run owns this run directory now", file=sys.stderr,
                      flush=True)
                liveness.say_bye()
                os._exit(ExitCode.LEASE_LOST)
            try:
                os.utime(self.path)
            except OSError as e:
                log.warning("could not refresh the heartbeat of %s: %s", self.path, e)

    def release(self) -> None:
        """Stop the heartbeat and remove the lease if it is still ours (rank 0; idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self.me is None:
            return
        got = read_lease(self.path)
        if got is not None and got[0].token == self.me.token:
            self.path.unlink(missing_ok=True)
            log.info("released the lease %s", self.path)
        self.me = None
