"""A user's own project, outside spmd: a 3-D field model and its task (used by the tests)."""
