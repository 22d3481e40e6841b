"""The feed: the global batch from the rows this process owns (`feed`), background reads
(`prefetch`), and re-reading a non-finite loss's batches on the host (`nan_probe`).
"""
