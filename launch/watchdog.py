"""Ranks never outlive their launcher: a process identity check and a watchdog thread.

A process is identified by (pid, start time), the start time being field 22 of
/proc/<pid>/stat (clock ticks since boot): a pid reused by another process has another start
time, and a zombie (state Z or X) counts as gone.

`spmd run` exports its own identity to every rank (`launcher_environ()`: SPMD_LAUNCHER_PID,
SPMD_LAUNCHER_START). `watch_launcher` (started by `bootstrap`, before jax.distributed waits
for anything) checks once a second that this process still exists; when it does not (SIGKILL,
OOM killer, closed terminal), the rank prints one line naming the launcher's pid and ends with
os._exit(ORPHANED_EXIT_CODE): no atexit handlers, no `finally`, so nothing more is written. A
save in flight stays an uncommitted temp directory, which restore ignores (commits are atomic
renames). Under srun/jsrun/PALS/Flux the scheduler ends orphaned ranks itself and these
variables are not set, so no thread runs.

Without /proc (not Linux) only existence is checked (kill(pid, 0)).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Mapping

LAUNCHER_PID_VAR = "SPMD_LAUNCHER_PID"
LAUNCHER_START_VAR = "SPMD_LAUNCHER_START"
ORPHANED_EXIT_CODE = 69  # EX_UNAVAILABLE (sysexits.h): the launcher this rank belongs to is gone

_watching: dict[str, threading.Thread] = {}


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


def _orphaned(who: str, pid: int) -> None:
    print(f"spmd: error: {who}: its launcher (`spmd run`, pid {pid}) is gone; ending this rank "
          f"with status {ORPHANED_EXIT_CODE} (saves in flight stay uncommitted; resume from the "
          "last committed checkpoint)", file=sys.stderr, flush=True)
    os._exit(ORPHANED_EXIT_CODE)


def watch_launcher(environ: Mapping[str, str], who: str,
                   interval_s: float = 1.0) -> threading.Thread | None:
    """Start (once per process) the thread that ends this rank when its launcher is gone."""
    launcher = launcher_from(environ)
    if launcher is None or "thread" in _watching:
        return _watching.get("thread")
    pid, start = launcher
    if not process_alive(pid, start):
        _orphaned(who, pid)

    def loop() -> None:
        while True:
            time.sleep(interval_s)
            if not process_alive(pid, start):
                _orphaned(who, pid)

    thread = threading.Thread(target=loop, name="spmd-launcher-watchdog", daemon=True)
    thread.start()
    _watching["thread"] = thread
    return thread
