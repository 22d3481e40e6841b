"""Errors a user can fix, and the one table of exit statuses.

The CLI prints a `SpmdError` as one message, no traceback, and exits with its `exit_code`.
`ExitCode` is the only place an exit status is defined: the trainer turns a stop into one,
job scripts requeue on `PREEMPTED`, and docs/run_directory.md lists them. A leaf: imports
nothing of spmd, so every layer (launch and sharding included) may import it.
"""

from enum import IntEnum


class ExitCode(IntEnum):
    """Every status a spmd process exits with on purpose (sysexits.h where one fits)."""

    OK = 0
    USER_ERROR = 2      # a config, launch, sharding or lease problem, or an exception from
    #                     the task's model (spmd.engine.model_errors); the message names it
    DOES_NOT_FIT = 3    # `spmd plan`: the run does not fit the devices' memory
    NONFINITE = 65      # EX_DATAERR: a non-finite loss or gradient norm stopped the run
    #                     (train.nonfinite); nothing non-finite was saved: lower optimizer.lr, rerun
    ORPHANED = 69       # EX_UNAVAILABLE: the launcher or a peer rank of this rank is gone
    LEASE_LOST = 73     # EX_CANTCREAT: another run took over this run directory's lease
    PREEMPTED = 75      # EX_TEMPFAIL: stopped for preemption after a save; requeue and resume
    HUNG = 76           # no training step completed within launch.step_timeout_s; the
    #                     ranks that did not reach the step are named; requeue and resume
    INTERRUPTED = 130   # 128 + SIGINT: Ctrl-C at the console


class SpmdError(Exception):
    """Base for errors whose message says what to fix (config key, path, variable)."""

    exit_code: int = ExitCode.USER_ERROR


class ConfigError(SpmdError):
    """A config file or override that does not validate."""
