"""The last, partial batch of a split, padded to a whole batch with copies of its first example.

Why: a split of `count` examples read in batches of `batch_size` ends in a batch of
r = count mod batch_size examples. A source's step q holds positions q*B .. q*B+B-1 of its
endless stream, so that last step wraps round to the split's first examples, which an
evaluation would then score twice. `PaddedTail(source, count, batch_size)` serves two steps
instead:

- step 0: positions q*B .. count-1 (the r real examples), then B - r copies of position q*B;
- step 1 (and any later one): B copies of position q*B.

An evaluation whose metrics are means over a batch's examples (`Task.eval_metrics`) then takes
the padding out exactly: the r real examples sum to B * mean(step 0) - (B - r) * mean(step 1).

Invariants: every row comes from the wrapped source's own `rows` (its decoding, normalization
of units, NaN handling and slab reads alike); a slab region passes through; the wrapped source
is never asked for a position at or past `count`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from spmd.data.batch import DataSource

__all__ = ["PaddedTail"]


class PaddedTail:
    """Steps 0 and 1 of a split's padded last batch (module docstring)."""

    prefetch_until = 2           # a background reader of the feed reads no further

    def __init__(self, source: DataSource, count: int, batch_size: int):
        real = count % batch_size
        if count < 1 or real == 0:
            raise ValueError(f"no partial last batch: {count} examples in batches of "
                             f"{batch_size}")
        self.source, self.batch_size = source, batch_size
        self.step = count // batch_size          # the wrapped source's step of the tail
        self.real = real                         # r: real examples in the last batch
        self.reads_slabs = bool(getattr(source, "reads_slabs", False))

    def rows(self, step: int, start: int, stop: int,
             region: Mapping[str, Any] | None = None) -> dict[str, np.ndarray]:
        if not 0 <= start <= stop <= self.batch_size:
            raise ValueError(f"rows [{start}, {stop}) outside the batch of {self.batch_size}")
        kw = {"region": region} if self.reads_slabs and region is not None else {}
        real_stop = min(stop, self.real) if step == 0 else start
        parts: list[dict[str, np.ndarray]] = []
        if real_stop > start:
            parts.append(self.source.rows(self.step, start, real_stop, **kw))
        copies = stop - max(start, real_stop)
        if copies > 0:
            first = self.source.rows(self.step, 0, 1, **kw)
            parts.append({k: np.repeat(v, copies, axis=0) for k, v in first.items()})
        if not parts:
            return self.source.rows(self.step, start, start, **kw)
        if len(parts) == 1:
            return {k: np.array(v) for k, v in parts[0].items()}   # not a pooled buffer
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
