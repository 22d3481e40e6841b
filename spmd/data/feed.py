"""Assemble global batches from the rows this process owns.

The rows a process must supply follow from the batch sharding (its addressable
shards), so the same code serves 1 process x 8 devices and 64 processes x 1.
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


def local_row_range(sharding: NamedSharding, global_shape: tuple[int, ...]) -> tuple[int, int]:
    """The contiguous range of batch rows held by this process's devices."""
    slices = [idx[0] for idx in sharding.addressable_devices_indices_map(global_shape).values()]
    starts = [s.start or 0 for s in slices]
    stops = [global_shape[0] if s.stop is None else s.stop for s in slices]
    lo, hi = min(starts), max(stops)
    covered = np.zeros(hi - lo, dtype=bool)
    for a, b in zip(starts, stops):
        covered[a - lo:b - lo] = True
    if not covered.all():
        raise ValueError(
            f"process {jax.process_index()} holds non-contiguous batch rows; "
            f"the batch axis must be laid out process-major"
        )
    return lo, hi


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

    def global_batch(self, source: DataSource, step: int) -> dict[str, jax.Array]:
        cache: dict[tuple[int, int], dict[str, np.ndarray]] = {}
        out = {}
        for name, field in self.fields.items():
            rows = self.ranges[name]
            if rows not in cache:
                cache[rows] = source.rows(step, *rows)
            local = np.asarray(cache[rows][name], dtype=field.dtype)
            out[name] = jax.make_array_from_process_local_data(
                self.shardings[name], local, field.global_shape(self.batch_size)
            )
        return out
