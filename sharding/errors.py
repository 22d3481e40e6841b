"""One error type for everything the sharding layer refuses."""

from spmd.errors import SpmdError


class ShardingError(SpmdError, ValueError):
    """A rule, mesh or annotation problem, with a message that names what to fix."""
