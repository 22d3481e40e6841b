"""The jax.distributed key-value store client: the one channel every multi-process job has.

Private JAX API (`jax._src.distributed.global_state.client`), read in this one place so a
JAX upgrade that moves it breaks one function. None when jax.distributed is not
initialized (one process) or the attribute moved.
"""

from __future__ import annotations

from typing import Any


def kv_client() -> Any | None:
    """The initialized jax.distributed client, or None."""
    try:
        from jax._src import distributed

        return distributed.global_state.client
    except (ImportError, AttributeError):
        return None
