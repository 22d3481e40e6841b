"""The one error type of the launch layer."""


class LaunchError(RuntimeError):
    """A launch problem the user can fix; the message names rank, host and variables."""

    exit_code = 2
