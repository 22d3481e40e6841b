"""Data: deterministic sources and the feed that assembles global batches."""
