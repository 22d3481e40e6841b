"""The one error type of the launch layer."""

from spmd.errors import SpmdError


class LaunchError(SpmdError, RuntimeError):
    """A launch problem the user can fix; the message names rank, host and variables."""

