"""Whether a checkpoint's parameters are finite: at save time, and when verifying one.

Retention must never delete the newest step whose parameters are finite: a run that diverged
(NaN/Inf in its parameters) would otherwise push out the last step worth resuming from. So
every save records `params_finite` (the persistent manifest, the local tier's COMMITTED
marker), computed when the save starts by `params_finite`: one jitted all-finite reduction
over the floating-point leaves of the state's parameters, read as one bool. Every rank calls
it at the same save (it is a collective over the state's devices) and gets the same answer.
A step without the field (written before it existed) counts as finite.

`spmd ckpt verify` reads the parameters back (`nonfinite_in_blob` for the local tier's
packed blobs, numpy only; `spmd.checkpoint.persistent.nonfinite_persistent` through Orbax,
onto the host) and names the step, each parameter path holding NaN/Inf and how many values
it holds.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger("spmd.checkpoint")

PARAMS_PREFIX = "params/"


def marked_finite(record: Mapping[str, Any] | None) -> bool:
    """A manifest's or marker's `params_finite`; absent (older steps) counts as finite."""
    return record is None or record.get("params_finite", True) is not False


_jitted: dict[str, Any] = {}


def _all_finite_fn() -> Any:
    if "fn" not in _jitted:
        import jax
        import jax.numpy as jnp

        def all_finite(leaves: list) -> Any:
            return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))

        _jitted["fn"] = jax.jit(all_finite)
    return _jitted["fn"]


def params_finite(params: Any) -> bool | None:
    """True when every floating-point leaf of `params` (a state's parameters) is finite
    (NaN/Inf: False); None when there are none or the check could not run (logged).

    Collective over the parameters' devices: every rank calls it for the same save.
    """
    import jax
    import jax.numpy as jnp

    if params is None:
        return None
    leaves = [x for x in jax.tree.leaves(params)
              if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)]
    if not leaves:
        return True
    try:
        try:
            result = _all_finite_fn()(leaves)
        except ValueError:   # leaves on different device sets: one reduction per leaf
            result = [jnp.all(jnp.isfinite(x)) for x in leaves]
        values = result if isinstance(result, list) else [result]
        return all(bool(np.asarray(jax.device_get(r.addressable_data(0)))) for r in values)
    except Exception as e:  # never fail a save over this check
        log.warning("could not check whether the parameters are finite (%s: %s); the step "
                    "counts as finite for retention", type(e).__name__, e)
        return None


_ML_FLOATS = {"bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3b11fnuz",
              "float8_e4m3fnuz", "float8_e5m2fnuz"}


def count_nonfinite(values: np.ndarray) -> int:
    """How many values of a floating-point array are NaN or +-Inf (0 for other dtypes)."""
    values = np.asarray(values)
    if values.dtype.kind not in "fc":
        if values.dtype.name not in _ML_FLOATS:
            return 0
        values = values.astype(np.float32)
    return int(values.size - np.count_nonzero(np.isfinite(values)))


def nonfinite_in_blob(blob: memoryview, pieces: list[dict]) -> dict[tuple[str, str], tuple]:
    """{(parameter path, piece index): (non-finite count, size)} of the `params/` pieces of
    one local-tier blob (its index's `pieces`), read from the blob's bytes."""
    from spmd.checkpoint.layout import np_dtype

    out = {}
    for p in pieces:
        path = p["path"]
        if not path.startswith(PARAMS_PREFIX):
            continue
        try:
            dtype = np_dtype(p["dtype"])
        except (TypeError, AttributeError, ImportError):
            continue
        raw = blob[p["offset"]:p["offset"] + p["nbytes"]]
        values = np.frombuffer(raw, dtype)
        out[(path[len(PARAMS_PREFIX):], str(p.get("index")))] = (count_nonfinite(values),
                                                                 values.size)
    return out


def describe_nonfinite(where: Path, step: int, counts: Mapping[str, tuple[int, int]]
                       ) -> list[dict]:
    """The parameters of `counts` holding non-finite values, as records naming step and path."""
    return [{"step": step, "where": str(where), "param": path, "nonfinite": n, "size": size}
            for path, (n, size) in sorted(counts.items()) if n]
