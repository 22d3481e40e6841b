"""Ranks never outlive their launcher: a process identity check and a watchdog thread.

A process is identified by (pid, start time), the start time being field 22 of
/proc/<pid>/stat (clock ticks since boot): a pid reused by another process has another start
time, and a zombie (state Z or X) counts as gone.

`spmd run` exports its own identity to every rank (`launcher_environ()`: SPMD_LAUNCHER_PID,
SPMD_LAUNCHER_START). `watch_launcher` (started by `bootstrap`, before jax.distributed waits
for anything) checks four times a second that this process still exists; when it does not (SIGKILL,
OOM killer, closed terminal), the rank prints one line naming the launcher's pid and ends with
os._exit(ExitCode.ORPHANED): no atexit handlers, no `finally`, so nothing more is written. A
save in flight stays an uncommitted temp directory, which restore ignores (commits are atomic
renames). Under srun/jsrun/PALS/Flux the scheduler ends orphaned ranks itself and these
variables are not set, so no thread runs.

Peers: `watch_peers` (bootstrap, under MPI) adds the other ranks on this host, learned by an
allgather of (host, pid, start time); when one is gone, this rank prints one line naming the
lost rank and ends the same way. `spmd run` tells Hydra's mpiexec not to kill the survivors
itself (-disable-auto-cleanup) and starts each rank behind a shim (spmd.launch.rank_shim), so
that Hydra's proxy, which SIGKILLs its other ranks when one dies by a signal, sees an exit
status instead. The watchdog wakes on a pidfd (Linux >= 5.3) the moment a peer exits. Ranks
on other hosts are covered by jax.distributed's heartbeat (launch.heartbeat_timeout_s) and
the scheduler.
A rank whose Python exits (normally or by an exception) first runs an atexit handler that
leaves a marker file `rank<R>` in a directory of the temp dir named after rank 0's (host, pid,
start time); a vanished peer with a marker ended on its own and is not a loss. SIGKILL, the
OOM killer, a crash, or os._exit (this watchdog, the lease, the init timeout) leave none.
The last rank of a host to exit removes the directory.

Without /proc (not Linux) only existence is checked (kill(pid, 0)).
"""

from __future__ import annotations

import atexit
import logging
import os
import select
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path

from spmd.errors import ExitCode
from spmd.launch import liveness

LAUNCHER_PID_VAR = "SPMD_LAUNCHER_PID"
LAUNCHER_START_VAR = "SPMD_LAUNCHER_START"

_watching: dict[str, threading.Thread] = {}
# key -> (pid, start time, message, marker file of a clean exit)
_watched: dict[str, tuple[int, int | None, str, Path | None]] = {}


def process_start_time(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot; None when gone, a zombie, or no /proc."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            text = fh.read().decode(errors="replace")
    except OSError:
        return None
    fields = text[text.rfind(")") + 2:].split()  # the command name may hold spaces and ')'
    if len(fields) < 20 or fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def process_alive(pid: int, start_time: int | None = None) -> bool:
    """Whether `pid` runs and (when given and /proc exists) started at `start_time`."""
    if pid <= 0:
        return False
    if os.path.isdir("/proc/self"):
        now = process_start_time(pid)
        return now is not None and (start_time is None or now == start_time)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def launcher_environ() -> dict[str, str]:
    """The variables that let the ranks started by this process watch it."""
    out = {LAUNCHER_PID_VAR: str(os.getpid())}
    start = process_start_time(os.getpid())
    if start is not None:
        out[LAUNCHER_START_VAR] = str(start)
    return out


def launcher_from(environ: Mapping[str, str]) -> tuple[int, int | None] | None:
    """(pid, start time) of the launcher named in `environ`, or None when none is named."""
    pid = environ.get(LAUNCHER_PID_VAR, "").strip()
    if not pid.isdigit():
        return None
    start = environ.get(LAUNCHER_START_VAR, "").strip()
    return int(pid), int(start) if start.isdigit() else None


def _end(line: str) -> None:
    text = (f"{line}; ending this rank with status {ExitCode.ORPHANED:d} (saves in flight stay "
            "uncommitted; resume from the last committed checkpoint)")
    # first into the rank's own log file, if one is open (a FileHandler flushes per record):
    # the launcher that forwards stderr may be tearing down, so the local file goes first
    record = logging.LogRecord("spmd.launch", logging.ERROR, __file__, 0, text, None, None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)
    print(f"spmd: error: {text}", file=sys.stderr, flush=True)
    liveness.say_bye()
    os._exit(ExitCode.ORPHANED)


_peers: dict[int, tuple[int, int | None]] = {}  # rank -> (pid, start) of this host's peers
_pidfds: dict[int, int] = {}   # pid -> pidfd (Linux >= 5.3): readable the moment it exits


def _wait(interval_s: float) -> None:
    """Sleep up to `interval_s`, waking at once when a watched process exits (pidfd)."""
    fds = [_pidfds[pid] for pid, *_ in list(_watched.values()) if pid in _pidfds]
    if not fds:
        time.sleep(interval_s)
        return
    try:
        select.select(fds, [], [], interval_s)
    except (OSError, ValueError):
        time.sleep(interval_s)


def _loop(interval_s: float) -> None:
    while True:
        _wait(interval_s)
        for key, (pid, start, line, mark) in list(_watched.items()):
            if not process_alive(pid, start):
                if mark is not None and mark.exists():  # it exited cleanly
                    _watched.pop(key, None)
                    continue
                if key not in _watched:  # disarmed meanwhile: this rank ends on purpose
                    continue
                _end(line)


def _watch(key: str, pid: int, start: int | None, line: str, interval_s: float,
           mark: Path | None = None) -> None:
    if not process_alive(pid, start) and not (mark is not None and mark.exists()):
        _end(line)
    _watched[key] = (pid, start, line, mark)
    if hasattr(os, "pidfd_open") and pid not in _pidfds:
        try:
            _pidfds[pid] = os.pidfd_open(pid)
        except OSError:
            pass  # older kernel: polling alone
    if "thread" not in _watching:
        thread = threading.Thread(target=_loop, args=(interval_s,), daemon=True,
                                  name="spmd-watchdog")
        thread.start()
        _watching["thread"] = thread


def watch_launcher(environ: Mapping[str, str], who: str, interval_s: float = 0.25) -> bool:
    """End this rank (within `interval_s`) once the launcher named in `environ` is gone."""
    launcher = launcher_from(environ)
    if launcher is None:
        return False
    pid, start = launcher
    _watch("launcher", pid, start, f"{who}: its launcher (`spmd run`, pid {pid}) is gone",
           interval_s)
    return True


def watch_peers(peers: Mapping[int, tuple[int, int | None]], rank: int, host: str, who: str,
                job_key: str, interval_s: float = 0.25) -> None:
    """End this rank once a peer {rank: (pid, start time)} on this host is gone uncleanly.

    `job_key` is the same on every rank of the job and differs between jobs.
    """
    # under `spmd run`, in its own temporary folder, which it removes however the job ends
    marks = Path(os.environ.get("SPMD_RUN_TMPDIR") or tempfile.gettempdir()) / (
        f"spmd-exits-{job_key}")
    marks.mkdir(parents=True, exist_ok=True)
    _exit_mark[:] = [(marks, rank, len(peers) + 1)]
    atexit.register(leave_exit_mark)
    _peers.update(peers)
    for peer, (pid, start) in peers.items():
        _watch(f"rank{peer}", pid, start,
               f"{who}: lost rank {peer} (pid {pid} on {host}): it ended without exiting "
               "cleanly (killed?)", interval_s, marks / f"rank{peer}")


_exit_mark: list[tuple[Path, int, int]] = []  # (marker dir, this rank, ranks on this host)


def leave_exit_mark() -> None:
    """Mark this rank as ended on its own (its peers do not report it lost); run at exit,
    and by a rank that ends with os._exit on purpose (a reported failure or hang). Its
    liveness beat to a recovery supervisor stops with it (spmd.launch.liveness)."""
    liveness.say_bye()
    if _exit_mark:
        _mark_exit(*_exit_mark.pop())


def _mark_exit(marks: Path, rank: int, count: int) -> None:
    try:
        (marks / f"rank{rank}").touch()
        if len(list(marks.iterdir())) >= count:
            shutil.rmtree(marks, ignore_errors=True)
    except OSError:
        pass


def disarm_peers() -> None:
    """Stop watching peers (before the shutdown barrier, after which they exit cleanly)."""
    for key in [k for k in _watched if k.startswith("rank")]:
        del _watched[key]



def local_peers() -> dict[int, tuple[int, int | None]]:
    """{rank: (pid, start time)} of the other ranks on this host, as learned at bootstrap
    (whether or not they are still watched)."""
    return dict(_peers)
