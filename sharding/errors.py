"""One error type for everything the sharding layer refuses."""


class ShardingError(ValueError):
    """A rule, mesh or annotation problem, with a message that names what to fix."""
