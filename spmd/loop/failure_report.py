"""How a rank's failure is put into words and into an exit status.

Used by the trainer when a run fails: the one line every rank and `spmd report` show, the
status the process exits with (the same as spmd.cli.main gives), and a line written to this
rank's log files only when its caller already prints the error to the terminal.
"""

from __future__ import annotations

import logging

from spmd.errors import ExitCode, SpmdError


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
