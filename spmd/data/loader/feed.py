"""Assemble global batches from the rows this process owns.

The rows a process must supply follow from the batch sharding (its addressable
shards), so the same code serves 1 process x 8 devices and 64 processes x 1.

Slabs: when a field is split along other axes too (e.g. x and y under `spatial`), a source
that declares `reads_slabs = True` is asked for this process's slab only:
`rows(step, start, stop, region={field: ((lo, hi), ...) per example axis})`, and must
return arrays of exactly that shape. Any other source is called as `rows(step, start,
stop)` and returns whole examples; JAX then keeps the part this process's devices hold.
An axis whose local indices are not one contiguous range is asked for in full.

Background reads (spmd.data.loader.prefetch): a source with `prefetch = k > 0` (ArraySource from
the config's data.prefetch) has the host arrays of steps s+1 .. s+k read by
`read_threads` daemon threads while step s runs: whole steps, or, for steps of more than
`MIN_PART_BYTES` per thread, each step's rows split into up to `read_threads` row
ranges. The thread that completes a step also builds its jax.Arrays (a host-to-device
copy, no collective: `jax.make_array_from_process_local_data`), so the caller only waits,
and its Python work never competes with the reads for the GIL. The calls are the same as
without prefetch, so the batches are bit-identical; a read error is raised by the step
that needs it.
`BatchFeed(prefetch=, read_threads=)` overrides what the source says (0: read in the call).

Waiting: `last_wait_s` is how long the last `global_batch` call blocked its caller (reading
and building the jax.Arrays, or waiting for the background threads to), `last_read_wait_s`
the part spent reading host data in the call or waiting for the threads; `total_wait_s` /
`calls` accumulate over every call.
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from spmd.data.batch import BatchField, DataSource
from spmd.data.loader.prefetch import Prefetcher
from spmd.errors import ConfigError
from spmd.sharding import RuleTable, logical_to_spec


def nearest_multiples(value: int, step: int) -> tuple[int, int]:
    """The two multiples of `step` nearest to `value` (both positive): 16, 64 -> (64, 128)."""
    below = value // step * step
    return (below, below + step) if below else (step, 2 * step)


def batch_size_error(batch_size: int, ways: int, mesh_axes: str,
                     key: str = "train.batch_size") -> ConfigError:
    """The one message for a batch that does not split over the data-parallel ways."""
    low, high = nearest_multiples(batch_size, ways)
    return ConfigError(f"{key}={batch_size} does not divide over the {ways} data-parallel ways "
                       f"(mesh {mesh_axes}); use a multiple of {ways}: {low} or {high}")


def batch_shardings(fields: Mapping[str, BatchField], batch_size: int, mesh: Mesh,
                    rules: RuleTable, *, batch_key: str = "train.batch_size"
                    ) -> dict[str, NamedSharding]:
    """Each field's sharding; a batch its data axes do not divide is a ConfigError naming
    `batch_key` (the config key or option that set `batch_size`) and the sizes that work."""
    shape = dict(mesh.shape)
    out = {}
    for name, f in fields.items():
        if f.axes[0] is not None:
            spec = logical_to_spec(f.axes[:1], rules, shape, path=f"batch/{name}",
                                   activation=True)
            entry = spec[0] if len(spec) else None
            axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
            ways = math.prod(shape[a] for a in axes)
            if batch_size % ways:
                raise batch_size_error(batch_size, ways,
                                       " x ".join(f"{a}={shape[a]}" for a in axes), batch_key)
        out[name] = NamedSharding(mesh, logical_to_spec(
            f.axes, rules, shape, shape=f.global_shape(batch_size), path=f"batch/{name}",
            activation=True))
    return out


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


def _fill(buffers: dict[str, np.ndarray], got: dict[str, np.ndarray], at: int) -> None:
    for name, buffer in buffers.items():
        value = got[name]
        buffer[at:at + len(value)] = value


class BatchFeed:
    """Per step: this process's rows from the source -> one global jax.Array per field."""

    MAX_READERS = 4            # sources read ahead at once (train, eval, ...); LRU beyond
    # A step's rows are split among the read threads only in parts of at least this many
    # bytes: smaller parts cost more in per-call overhead and thread hand-offs than they
    # gain (h5py serializes calls; Zarr reads a call's chunks concurrently anyway), and
    # the threads then read whole steps ahead instead.
    MIN_PART_BYTES = 8 << 20

    def __init__(self, fields: Mapping[str, BatchField], batch_size: int, mesh: Mesh,
                 rules: RuleTable, *, prefetch: int | None = None,
                 read_threads: int | None = None, batch_key: str = "train.batch_size"):
        self.fields = dict(fields)
        self.batch_size = batch_size
        self.shardings = batch_shardings(fields, batch_size, mesh, rules, batch_key=batch_key)
        self.ranges = {
            name: local_row_range(self.shardings[name], f.global_shape(batch_size))
            for name, f in self.fields.items()
        }
        self.regions = {
            name: local_region(self.shardings[name], f.global_shape(batch_size))
            for name, f in self.fields.items()
        }
        self.prefetch, self.read_threads = prefetch, read_threads   # None: as the source says
        self.last_wait_s = 0.0
        self.last_read_wait_s = 0.0
        self.total_wait_s = 0.0
        self.calls = 0
        self._readers: collections.OrderedDict[int, tuple[Any, Prefetcher]] = \
            collections.OrderedDict()

    def local_shape(self, name: str, slab: bool) -> tuple[int, ...]:
        """The shape of this process's part of field `name` that a source returns."""
        lo, hi = self.ranges[name]
        example = (tuple(b - a for a, b in self.regions[name]) if slab
                   else self.fields[name].example_shape)
        return (hi - lo, *example)

    # ------------------------------------------------------------ host data

    def _groups(self) -> dict[tuple[int, int], list[str]]:
        """Fields by the rows this process holds (one source call per distinct range)."""
        groups: dict[tuple[int, int], list[str]] = {}
        for name in self.fields:
            groups.setdefault(self.ranges[name], []).append(name)
        return groups

    def _read(self, source: DataSource, step: int, rows: tuple[int, int], names: list[str],
              slab: bool, part: tuple[int, int] | None = None) -> dict[str, np.ndarray]:
        """Fields `names` of rows `part` (default: all of `rows`) of `step`, checked."""
        lo, hi = part or rows
        if slab:
            got = source.rows(step, lo, hi, region={k: self.regions[k] for k in names})
        else:
            got = source.rows(step, lo, hi)
        out = {}
        for name in names:
            local = np.asarray(got[name], dtype=self.fields[name].dtype)
            want = (hi - lo, *self.local_shape(name, slab)[1:])
            if local.shape != want:
                raise ValueError(
                    f"{type(source).__name__}.rows(step={step}, rows={(lo, hi)}) returned "
                    f"field '{name}' of shape {local.shape}; this process needs {want}"
                    + (f" (region {self.regions[name]})" if slab else "")
                )
            out[name] = local
        return out

    def host_batch(self, source: DataSource, step: int) -> dict[str, np.ndarray]:
        """This process's host arrays of `step`, read in this thread (no prefetch)."""
        slab = bool(getattr(source, "reads_slabs", False))
        out: dict[str, np.ndarray] = {}
        for rows, names in self._groups().items():
            out.update(self._read(source, step, rows, names, slab))
        return out

    def _plan(self, source: DataSource, threads: int):
        """Per step: parts (row ranges of each group, read by the pool) and their join."""
        slab = bool(getattr(source, "reads_slabs", False))
        groups = self._groups()

        def plan(step: int):
            parts, out = [], {}
            for rows, names in groups.items():
                lo, hi = rows
                nbytes = sum(int(np.prod(self.local_shape(k, slab))) *
                             self.fields[k].dtype.itemsize for k in names)
                n = max(1, min(threads, hi - lo, nbytes // self.MIN_PART_BYTES))
                if n == 1:
                    parts.append(lambda r=rows, m=names: out.update(
                        self._read(source, step, r, m, slab)))
                    continue
                buffers = {k: np.empty(self.local_shape(k, slab), self.fields[k].dtype)
                           for k in names}
                out.update(buffers)
                cuts = [lo + (hi - lo) * k // n for k in range(n + 1)]
                for a, b in zip(cuts[:-1], cuts[1:]):
                    parts.append(lambda r=rows, m=names, p=(a, b), into=buffers:
                                 _fill(into, self._read(source, step, r, m, slab, p),
                                       p[0] - r[0]))
            return parts, lambda _: self.device_batch(out)

        return plan

    def _reader(self, source: DataSource) -> Prefetcher | None:
        depth = self.prefetch if self.prefetch is not None else getattr(source, "prefetch", 0)
        if not depth:
            return None
        key = id(source)
        if key in self._readers:
            self._readers.move_to_end(key)
            return self._readers[key][1]
        threads = (self.read_threads if self.read_threads is not None
                   else getattr(source, "read_threads", 1))
        reader = Prefetcher(self._plan(source, max(1, int(threads))), int(depth),
                            max(1, int(threads)),
                            until=getattr(source, "prefetch_until", None),
                            name=f"spmd-read-{type(source).__name__}")
        self._readers[key] = (source, reader)      # holds the source: its id stays unique
        while len(self._readers) > self.MAX_READERS:
            self._readers.popitem(last=False)[1][1].close()
        return reader

    def close(self) -> None:
        """Stop the background reads (also done at interpreter exit)."""
        readers, self._readers = self._readers, collections.OrderedDict()
        for _, reader in readers.values():
            reader.close()

    # ------------------------------------------------------------ the batch

    def device_batch(self, local: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
        """This process's host arrays -> the global jax.Arrays (no communication). One
        process holds the whole batch: one batched `device_put` for every field."""
        names = list(self.fields)
        if jax.process_count() == 1:
            put = jax.device_put([local[n] for n in names], [self.shardings[n] for n in names])
            return dict(zip(names, put))
        return {name: jax.make_array_from_process_local_data(
                    self.shardings[name], local[name], field.global_shape(self.batch_size))
                for name, field in self.fields.items()}

    def global_batch(self, source: DataSource, step: int) -> dict[str, jax.Array]:
        if not self.fields:
            return {}
        began = time.perf_counter()
        reader = self._reader(source)
        if reader is None:
            local = self.host_batch(source, step)
            read_wait = time.perf_counter() - began
            out = self.device_batch(local)
        else:
            out, read_wait = reader.get(step)
        self.last_read_wait_s = read_wait
        self.last_wait_s = time.perf_counter() - began
        self.total_wait_s += self.last_wait_s
        self.calls += 1
        return out
