"""How a rank's failure is put into words and into an exit status.

Used by the trainer when a run fails (`report_failure`): the one line every rank and `spmd
report` show, the status the process exits with (the same as spmd.cli.main gives), a line
written to this rank's log files only when its caller already prints the error to the
terminal, the word to every other rank, and the `failed` record; a hang's `hung` record and
run.dir/HUNG (`record_hang`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from spmd.comm.hang_watchdog import HUNG_FILE_NAME, HangReport
from spmd.comm.job_failure import announce
from spmd.errors import ExitCode, SpmdError

if TYPE_CHECKING:
    from spmd.launch import LaunchEnv
    from spmd.rundir.metrics import EventLog

log = logging.getLogger("spmd.loop.trainer")   # the trainer's own lines, as before the move


def failure_line(e: BaseException) -> str:
    """`Type: message` of an exception, on one line (the message's first line for others)."""
    if isinstance(e, SpmdError):
        return str(e)
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def exit_status(e: BaseException) -> int:
    """The status this process exits with for `e` (as spmd.cli.main gives it)."""
    if isinstance(e, SpmdError):
        return int(e.exit_code)
    if isinstance(e, KeyboardInterrupt):
        return ExitCode.INTERRUPTED
    if isinstance(e, SystemExit) and isinstance(e.code, int):
        return e.code
    return 1


def log_to_files(logger: logging.Logger, level: int, msg: str, *args: object) -> None:
    """`logger.log(level, msg, *args)` into this rank's log files only (not stderr)."""
    record = logger.makeRecord(logger.name, level, __file__, 0, msg, args, None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler) and record.levelno >= handler.level:
            handler.handle(record)


def report_failure(env: LaunchEnv, e: BaseException, events: EventLog | None, *,
                   logs_to_file: bool) -> None:
    """Log this rank's error where its user looks, end every other rank now with this
    status (instead of waiting for this one), and record how the job ended (`events`, once
    the run has one; `logs_to_file`: this rank's log file in run.dir is open)."""
    error = failure_line(e)
    if isinstance(e, SpmdError) and env.size == 1:
        # one process: its caller shows the error (`spmd train: error: ...`, or the
        # exception), once; this run's log file, if it has one yet, keeps it too
        if logs_to_file:
            log_to_files(log, logging.ERROR, "%s: %s", env.who, error)
    elif isinstance(e, SpmdError | KeyboardInterrupt):
        log.error("%s: %s", env.who, error)
    else:
        log.error("%s failed: %s", env.who, error, exc_info=True)
    first = announce(env, error, exit_status(e), type(e).__name__)
    if events is not None:  # how this job ended, for `spmd report`
        events.record("failed", error=error[:500], exit_code=exit_status(e), first=first)


def record_hang(run_dir: Path, events: EventLog, report: HangReport) -> None:
    """The reporting rank's record of a hang: a `hung` event, and run.dir/HUNG, which
    `spmd run` and the job scripts read for the job's status (ExitCode.HUNG: requeue)."""
    events.record("hung", **report.to_dict(), exit_code=int(ExitCode.HUNG))
    (run_dir / HUNG_FILE_NAME).write_text(json.dumps({"line": report.line(),
                                                      **report.to_dict()}) + "\n")
