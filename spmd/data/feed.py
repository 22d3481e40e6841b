"""Assemble global batches from the rows this process owns.

The rows a process must supply follow from the batch sharding (its addressable
shards), so the same code serves 1 process x 8 devices and 64 processes x 1.

Slabs: when a field is split along other axes too (e.g. x and y under `spatial`), a source
that declares `reads_slabs = True` is asked for this process's slab only:
`rows(step, start, stop, region={field: ((lo, hi), ...) per example axis})`, and must
return arrays of exactly that shape. Any other source is called as `rows(step, start,
stop)` and returns whole examples; JAX then keeps the part this process's devices hold.
An axis whose local indices are not one contiguous range is asked for in full.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from spmd.data.batch import BatchField, DataSource
from spmd.sharding import RuleTable, logical_to_spec


def batch_shardings(fields: Mapping[str, BatchField], batch_size: int, mesh: Mesh,
                    rules: RuleTable) -> dict[str, NamedSharding]:
    return {
        name: NamedSharding(mesh, logical_to_spec(
            f.axes, rules, dict(mesh.shape), shape=f.global_shape(batch_size),
            path=f"batch/{name}", activation=True,
        ))
        for name, f in fields.items()
    }


def local_index_range(sharding: NamedSharding, global_shape: tuple[int, ...],
                      axis: int) -> tuple[int, int] | None:
    """The range of indices along `axis` held by this process's devices; None when they do
    not form one contiguous range."""
    slices = [idx[axis] for idx in sharding.addressable_devices_indices_map(global_shape).values()]
    starts = [s.start or 0 for s in slices]
    stops = [global_shape[axis] if s.stop is None else s.stop for s in slices]
    lo, hi = min(starts), max(stops)
    covered = np.zeros(hi - lo, dtype=bool)
    for a, b in zip(starts, stops):
        covered[a - lo:b - lo] = True
    return (lo, hi) if covered.all() else None


def local_row_range(sharding: NamedSharding, global_shape: tuple[int, ...]) -> tuple[int, int]:
    """The contiguous range of batch rows held by this process's devices."""
    rows = local_index_range(sharding, global_shape, 0)
    if rows is None:
        raise ValueError(
            f"process {jax.process_index()} holds non-contiguous batch rows; "
            f"the batch axis must be laid out process-major"
        )
    return rows


def local_region(sharding: NamedSharding, global_shape: tuple[int, ...]
                 ) -> tuple[tuple[int, int], ...]:
    """Per example axis (all axes but the batch), the [lo, hi) this process needs."""
    return tuple(local_index_range(sharding, global_shape, axis) or (0, global_shape[axis])
                 for axis in range(1, len(global_shape)))


class BatchFeed:
    """Per step: this process's rows from the source -> one global jax.Array per field."""

    def __init__(self, fields: Mapping[str, BatchField], batch_size: int, mesh: Mesh,
                 rules: RuleTable):
        self.fields = dict(fields)
        self.batch_size = batch_size
        self.shardings = batch_shardings(fields, batch_size, mesh, rules)
        self.ranges = {
            name: local_row_range(self.shardings[name], f.global_shape(batch_size))
            for name, f in self.fields.items()
        }
        self.regions = {
            name: local_region(self.shardings[name], f.global_shape(batch_size))
            for name, f in self.fields.items()
        }

    def local_shape(self, name: str, slab: bool) -> tuple[int, ...]:
        """The shape of this process's part of field `name` that a source returns."""
        lo, hi = self.ranges[name]
        example = (tuple(b - a for a, b in self.regions[name]) if slab
                   else self.fields[name].example_shape)
        return (hi - lo, *example)

    def global_batch(self, source: DataSource, step: int) -> dict[str, jax.Array]:
        slab = bool(getattr(source, "reads_slabs", False))
        cache: dict[tuple[int, int], dict[str, np.ndarray]] = {}
        out = {}
        for name, field in self.fields.items():
            rows = self.ranges[name]
            if rows not in cache:
                if slab:
                    region = {k: self.regions[k] for k in self.fields if self.ranges[k] == rows}
                    cache[rows] = source.rows(step, *rows, region=region)
                else:
                    cache[rows] = source.rows(step, *rows)
            local = np.asarray(cache[rows][name], dtype=field.dtype)
            want = self.local_shape(name, slab)
            if local.shape != want:
                raise ValueError(
                    f"{type(source).__name__}.rows(step={step}, rows={rows}) returned field "
                    f"'{name}' of shape {local.shape}; this process needs {want}"
                    + (f" (region {self.regions[name]})" if slab else "")
                )
            out[name] = jax.make_array_from_process_local_data(
                self.shardings[name], local, field.global_shape(self.batch_size)
            )
        return out
