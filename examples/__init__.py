"""User projects built on spmd's public API only (not installed; run from the repository root)."""
