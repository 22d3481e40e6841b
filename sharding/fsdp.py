"""FSDP for any model: split big parameters over `fsdp` where no rule does.

Rules place the parameters of models written with the reference vocabulary (`embed` on
`fsdp`). A conv net, an operator or a GNN often has no such name, so under a mesh whose `fsdp`
axis is larger than 1 each parameter that

- is at least `RuleTable.fsdp_min_bytes` bytes (config `mesh.fsdp_min_bytes`), and
- has no dimension on `fsdp` after the rules (explicit rules win, and keep their strict
  divisibility errors),

is split over `fsdp` along one dimension, chosen as big_vision's fsdp rule does: the largest
dimension that the fsdp size divides and that no other mesh axis shards already (so never a
dimension on `stage` or `tensor`); the stacked `layers` dimension of scanned layers is never
chosen (the scan would gather a slice every step). Among equal sizes the last dimension wins
(kernels are (in, out): the output features). A parameter with no such dimension, or below
the threshold, stays as the rules left it. Pure: the choice depends only on the shape, dtype,
logical axes, rule table and mesh sizes, so a restore or a reshard onto the same mesh
recomputes the same placement.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from jax.sharding import PartitionSpec

FSDP = "fsdp"
LAYERS = "layers"


def _axes_of(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def auto_fsdp_dim(
    shape: Sequence[int],
    dtype,
    spec: PartitionSpec,
    logical_axes: Sequence[str | None],
    mesh_shape: Mapping[str, int],
    min_bytes: int | None,
) -> int | None:
    """The dimension to split over `fsdp`, or None to leave `spec` as the rules made it."""
    ways = mesh_shape.get(FSDP, 1)
    if min_bytes is None or ways <= 1 or not shape:
        return None
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    if nbytes < min_bytes:
        return None
    entries = list(spec) + [None] * (len(shape) - len(spec))
    if any(FSDP in _axes_of(e) for e in entries):
        return None
    free = [d for d, size in enumerate(shape)
            if not _axes_of(entries[d]) and size >= ways and size % ways == 0
            and (d >= len(logical_axes) or logical_axes[d] != LAYERS)]
    if not free:
        return None
    return max(free, key=lambda d: (shape[d], d))


def with_fsdp_on(spec: PartitionSpec, ndim: int, dim: int) -> PartitionSpec:
    """`spec` with dimension `dim` (replicated in `spec`) put on `fsdp`."""
    entries = list(spec) + [None] * (ndim - len(spec))
    entries[dim] = FSDP
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)
