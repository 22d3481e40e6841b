"""A preemption signal that reaches `spmd run` or `spmd train` while Python is still starting.

Why: until the run installs its own handlers (spmd run's forwarding, a rank's
`spmd.launch.PreemptionWatcher`), SIGTERM's default action would end the process with 143
and no word, and a scheduler's warning in the first second of a job would be lost.

`catch(argv)`, called by the `spmd.cli` package before anything heavy is imported, installs
`HANDLER` for SIGTERM, SIGUSR1 and SIGUSR2 when the process is the `spmd` console script (or
`python -m spmd.cli`) running `run` or `train`; it only records the first signal's number in
`HANDLER.received`. Whoever installs the next handler takes that record over:
`PreemptionWatcher.install` reads `received` from the handler it replaces (no import: a
duck-typed attribute, so spmd.launch imports nothing of the CLI), and `spmd run` reads
`HANDLER.received` itself. Imports nothing but the standard library's `os`, `signal`, `sys`.
"""

from __future__ import annotations

import os
import signal
import sys

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
ENTRIES = ("run", "train")


class EarlyHandler:
    """A signal handler that records the first signal's number in `received`."""

    def __init__(self) -> None:
        self.received: int | None = None

    def __call__(self, signum: int, frame: object) -> None:
        if self.received is None:
            self.received = signum


HANDLER = EarlyHandler()


def catch(argv: list[str] | None = None) -> bool:
    """Install HANDLER when this process is `spmd run` or `spmd train`; whether it did."""
    argv = sys.argv if argv is None else argv
    if not argv:
        return False
    head = argv[0]
    console = head == "-m" or os.path.basename(head) == "spmd" or head.endswith(
        os.path.join("spmd", "cli", "__main__.py"))
    words = [a for a in argv[1:] if not a.startswith("-")]
    if not console or not words or words[0] not in ENTRIES:
        return False
    try:
        for s in SIGNALS:
            signal.signal(s, HANDLER)
    except ValueError:  # not the main thread: nothing to catch early
        return False
    return True
