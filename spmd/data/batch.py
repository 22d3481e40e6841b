"""The types that describe a batch: what a task declares and a data source delivers.

The data layer owns these; tasks import them, never the reverse. A data source is a pure
function of (step, rows): that is what makes a resumed run bit-identical and lets any
process count assemble the same global batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass(frozen=True)
class BatchField:
    """One array of a batch: per-example shape, dtype, and logical axes including `batch`."""

    example_shape: tuple[int, ...]
    dtype: np.dtype
    axes: tuple[str | None, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "example_shape", tuple(int(n) for n in self.example_shape))
        object.__setattr__(self, "dtype", np.dtype(self.dtype))
        object.__setattr__(self, "axes", tuple(self.axes))
        if len(self.axes) != len(self.example_shape) + 1:
            raise ValueError(f"BatchField axes {self.axes} need one name per dimension of "
                             f"(batch, *{self.example_shape}), the first for the batch")

    def global_shape(self, batch_size: int) -> tuple[int, ...]:
        return (batch_size, *self.example_shape)


class DataSource(Protocol):
    """Rows [start, stop) of the global batch at `step`, identical for any process count.

    A source may also set `reads_slabs = True` and accept `rows(step, start, stop, region=)`
    with `region[field]` = ((lo, hi), ...) per example axis: it then returns only that slab
    of each example (what this process's devices hold when a field is split spatially).
    """

    def rows(self, step: int, start: int, stop: int) -> dict[str, np.ndarray]: ...

