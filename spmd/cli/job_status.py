"""The exit status of a job under `spmd run`, decided from its ranks' own statuses.

Each rank runs behind a shim (spmd.launch.rank_shim) that leaves the rank's exit status in
`spmd run`'s temporary folder (`status-<shim pid>`). The job's status is decided from
those (`job_status`), not from what the MPI launcher makes of them: Hydra ORs them together
(69 | 137 = 205).

Invariants:
- The status is one of the table (spmd.errors.ExitCode) or a rank's own: the cause of a
  failure, not its consequences (ranks that followed a failed or hung one, ORPHANED).
- A preemption signal that every rank stopped for, died of before it could act on, or
  finished despite, makes the job PREEMPTED (75: requeue).
- No status is decided while a rank left none (its shim was killed): the launcher's stands.
"""

from __future__ import annotations

import signal
from pathlib import Path

from spmd.errors import ExitCode

PREEMPTING = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)  # a rank's watcher's signals


def rank_statuses(folder: Path) -> list[int]:
    """The exit statuses the rank shims left in `folder` (one per rank that ended)."""
    found = []
    for path in folder.glob("status-*"):
        if path.suffix == ".tmp":
            continue
        try:
            found.append(int(path.read_text().strip()))
        except (OSError, ValueError):
            continue
    return found


def job_status(statuses: list[int], n: int, signalled: int | tuple[int, ...] | None = None
               ) -> int | None:
    """The job's status in the table (ExitCode) from its `n` ranks' own `statuses`; None
    when some rank left none (its shim was killed: the launcher's status stands).

    - every rank 0: 0; every non-zero status the same: that one;
    - `signalled` (the signal this process forwarded to the ranks, or several: the one it
      received too, which a whole-job signal also sends every rank directly) a preemption
      signal, and each rank either stopped for it (75), died of one of them before it could
      act on it (128+S: its first moment, before Python ran) or finished (0: the run was at
      its end): PREEMPTED;
    - else a status of the table other than ORPHANED (the cause; the others follow it: a
      failure's, a hang's), the most frequent one; else ORPHANED when a rank was lost (died
      by a signal, 128+S) or a survivor named it so.
    """
    if len(statuses) < n:
        return None
    failed = [c for c in statuses if c != 0]
    if not failed:
        return ExitCode.OK
    table = {int(c) for c in ExitCode}
    if len(set(failed)) == 1 and (failed[0] <= 128 or failed[0] in table):
        return failed[0]   # (130: Ctrl-C, which the ranks take as KeyboardInterrupt)
    sent = (signalled,) if isinstance(signalled, int) else tuple(signalled or ())
    if any(s in PREEMPTING for s in sent) and all(
            c == ExitCode.PREEMPTED or c - 128 in sent for c in failed):
        return ExitCode.PREEMPTED
    causes = [c for c in failed if c != ExitCode.ORPHANED and c <= 128]
    if causes:
        return max(sorted(set(causes)), key=causes.count)
    return ExitCode.ORPHANED


def killed_starting(statuses: list[int], code: int, signalled: tuple[int, ...]) -> bool:
    """Whether the ranks without a status died of the preemption signal this process sent,
    in their shim's first moment, before its Python could block it (the shim then leaves no
    status): the launcher reports that signal (`code`: S or 128+S), and every rank that left
    a status stopped for it, died of it or finished."""
    deaths = {s for sig in signalled for s in (sig, 128 + sig)}
    return (any(s in PREEMPTING for s in signalled) and code in deaths
            and all(c in (0, ExitCode.PREEMPTED) or c - 128 in signalled for c in statuses))


def received(ending: dict[str, float]) -> tuple[int, ...]:
    """The signals the ranks may have had from this job's ending: the one forwarded to them,
    and the one this process received (a whole-job signal reaches every rank directly)."""
    return tuple(int(ending[k]) for k in ("forwarded", "signal") if k in ending)
