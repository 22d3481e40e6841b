"""One rank's parent under `spmd run`: Hydra sees an exit code, never a death by signal.

`python .../launch/rank_shim.py CMD...` starts CMD (the rank) and exits with its status; a
rank killed by signal S (SIGKILL, the OOM killer) becomes exit status 128+S. Why: Hydra's
proxy SIGKILLs every other rank the moment one of its ranks dies by a signal, so the
survivors could never say which rank was lost. Behind a shim they live on; each one's
watchdog (spmd.launch.watchdog) names the lost rank, in its log and on stderr, and ends it.

Invariants:
- The rank never outlives its shim: PR_SET_PDEATHSIG=SIGKILL (Linux), so a proxy that still
  SIGKILLs its children (it does on any failure of its own) takes the ranks with it.
- Every signal the proxy sends that a rank acts on is passed on to the rank (Hydra starts
  each rank in its own session, so this is the only way signals reach it), including one
  sent before the rank exists or just as the shim starts to wait; none sent after the rank
  ended is acted on.
- The rank inherits every file descriptor and the environment; the shim then closes its own
  copy of Hydra's PMI socket (PMI_FD), whose lifetime must be the rank's.
- It imports nothing heavy: run by its file path, it loads no jax or numpy, and of spmd only
  the root's lazy `__init__` and spmd.atomic_write (the standard library only).
- Under `spmd run` (SPMD_RUN_TMPDIR set), it leaves the rank's exit status in that folder
  (`status-<shim pid>`), so that `spmd run` decides the job's status from the ranks' own
  statuses, not from what the MPI launcher makes of them (Hydra ORs them together).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from spmd.atomic_write import write_atomic

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2, signal.SIGCONT, signal.SIGTSTP)
WATCHED = {*FORWARDED, signal.SIGCHLD}  # blocked in the shim, taken one at a time by sigwait
RUN_TMPDIR_VAR = "SPMD_RUN_TMPDIR"   # `spmd run`'s own temporary folder (statuses, marks)


def report_status(status: int) -> None:
    """Leave `status` in $SPMD_RUN_TMPDIR/status-<pid> (whole, by rename), if it is set."""
    folder = os.environ.get(RUN_TMPDIR_VAR, "")
    if not folder:
        return
    try:
        write_atomic(os.path.join(folder, f"status-{os.getpid()}"), f"{status}\n", durable=False)
    except OSError:
        pass  # `spmd run` then decides from the launcher's status


def die_with_parent() -> None:
    """In a child before exec: SIGKILL it when its parent dies (Linux prctl)."""
    try:
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def exit_status(returncode: int) -> int:
    """Popen's returncode (-S for a death by signal S) as an exit status: 128+S."""
    return 128 - returncode if returncode < 0 else returncode


def start_rank(argv: list[str]) -> subprocess.Popen:
    """Start the rank with the shim's blocked signals unblocked (exec keeps a signal mask)."""
    def in_child() -> None:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, WATCHED)
        if sys.platform == "linux":
            die_with_parent()

    return subprocess.Popen(argv, close_fds=False, preexec_fn=in_child)


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python rank_shim.py CMD [ARG...]", file=sys.stderr)
        return 2
    # the shim keeps every watched signal blocked and takes them with sigwait, so none can
    # slip in between a handler check and a blocking wait (a Python handler would run only
    # after the rank had exited); a signal sent before the rank exists waits its turn
    signal.pthread_sigmask(signal.SIG_BLOCK, WATCHED)
    try:
        child = start_rank(argv)
    except OSError as e:
        print(f"spmd rank shim: cannot start {argv[0]}: {e}", file=sys.stderr)
        return 127
    # Hydra's PMI socket must close when the rank's copy does (a socket that closes without a
    # PMI finalize makes the proxy signal the other ranks), so the shim keeps none
    if (pmi_fd := os.environ.get("PMI_FD", "")).isdigit():
        try:
            os.close(int(pmi_fd))
        except OSError:
            pass
    while (returncode := child.poll()) is None:
        signum = signal.sigwait(WATCHED)
        if signum != signal.SIGCHLD:
            try:
                os.kill(child.pid, signum)
            except ProcessLookupError:
                pass
    # the rank is gone: what the proxy still sends (Hydra signals SIGUSR1 as ranks close their
    # PMI sockets) stays blocked and cannot turn the shim's clean exit into a death by signal
    status = exit_status(returncode)
    report_status(status)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
