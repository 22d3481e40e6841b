"""Errors a user can fix: the CLI prints them as one message, no traceback."""


class SpmdError(Exception):
    """Base for errors whose message says what to fix (config key, path, variable)."""

    exit_code = 2


class ConfigError(SpmdError):
    """A config file or override that does not validate."""
