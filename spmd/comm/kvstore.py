"""The jax.distributed key-value store client: the one channel every multi-process job has.

Private JAX API (`jax._src.distributed.global_state.client`), read in this one place so a
JAX upgrade that moves it breaks one function. None when jax.distributed is not
initialized (one process) or the attribute moved.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


def kv_client() -> Any | None:
    """The initialized jax.distributed client, or None."""
    try:
        from jax._src import distributed

        return distributed.global_state.client
    except (ImportError, AttributeError):
        return None


@dataclass
class Outcome:
    """What a bounded call to the store gave: its value, or why not (`error`)."""

    ok: bool
    value: Any = None
    error: str = ""


def bounded(fn: Callable[[], Any], timeout_s: float) -> Outcome:
    """`fn()` (a call to the store) on a helper thread, given up after `timeout_s`: the store
    lives in rank 0's process, which may be the stopped or stuck one."""
    out = Outcome(False, error=f"no answer within {timeout_s:g} s")

    def call() -> None:
        try:
            out.value, out.ok = fn(), True
        except Exception as e:  # the client raises its own runtime error type
            out.error = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]

    thread = threading.Thread(target=call, daemon=True, name="spmd-kv-call")
    thread.start()
    thread.join(timeout_s)
    return out
