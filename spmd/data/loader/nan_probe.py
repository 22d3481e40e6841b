"""Was it the data? A non-finite loss's batches read again on the host, NaN / Inf located.

Why: a NaN in one time step of a file stops training with a non-finite loss, and a message
that only says "lower optimizer.lr" sends the user the wrong way. When the run stops
(spmd.loop.builtin_hooks.NonfiniteHook), `nonfinite_in_batches` reads the train batches of
the steps in question once more (the order is a pure function of the step, so they are the
same batches) and names the first non-finite value's field, file, dataset and record, so
the advice can point at the data. Only on that failure path: it costs nothing otherwise.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["nonfinite_in_batches"]


def _where(source: Any, name: str, step: int, row: int) -> str:
    """file, dataset and record of row `row` of `step`, as far as the source can tell."""
    try:
        record = source.record_indices(step, row, row + 1)[0]
        member, at = source.locate(name, record)
        path = source.files.members[member].path
        dataset = (getattr(source, "datasets", {}) or {}).get(name) or getattr(
            source, "dataset", "?")
        return f"file {path}, dataset '{dataset}', record {record} (row {at} of the file)"
    except Exception:                   # a source without those hooks: the batch row only
        return f"row {row} of the global batch"


def nonfinite_in_batches(source: Any, steps: range, batch_size: int, *,
                         limit: int = 16) -> str | None:
    """The first non-finite input value in the train batches of `steps` (0-based source
    steps; the last `limit` of them), in words, or None when they are all finite or cannot
    be read again."""
    for step in list(steps)[-limit:]:
        try:
            batch = source.rows(step, 0, batch_size)
        except Exception:               # the data cannot be read again: say nothing
            return None
        for name, values in batch.items():
            a = np.asarray(values)
            if not np.issubdtype(a.dtype, np.floating) or a.ndim == 0:
                continue
            bad = ~np.isfinite(a)
            if bad.any():
                row = int(np.flatnonzero(bad.reshape(len(a), -1).any(axis=1))[0])
                return (f"the batch of step {step + 1} holds {int(bad.sum())} non-finite "
                        f"value(s) in field '{name}' ({_where(source, name, step, row)})")
    return None
