"""Resolve a whole parameter tree (an nnx.State of Variables) to shardings."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from spmd.sharding.annotate import LOGICAL_AXES_KEY
from spmd.sharding.errors import ShardingError
from spmd.sharding.resolve import logical_to_spec
from spmd.sharding.rules import RuleTable


def path_str(path: tuple) -> str:
    """`('layers', 0, 'mlp', 'up', 'kernel')` -> `layers/0/mlp/up/kernel`.

    Takes nnx paths and jax key paths alike (DictKey.key, GetAttrKey.name, SequenceKey.idx).
    """
    def part(p) -> str:
        for attr in ("key", "name", "idx"):
            if hasattr(p, attr):
                return str(getattr(p, attr))
        return str(p)

    return "/".join(part(p) for p in path)


@dataclass(frozen=True)
class ParamSharding:
    """One parameter's resolved placement."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    logical_axes: tuple[str | None, ...]
    spec: PartitionSpec

    def bytes_total(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    def bytes_per_device(self, mesh_shape: dict[str, int]) -> int:
        ways = 1
        for entry in self.spec:
            for axis in (entry,) if isinstance(entry, str) else (entry or ()):
                ways *= mesh_shape[axis]
        return self.bytes_total() // ways


def logical_axes_of(variable: nnx.Variable, path: str) -> tuple[str | None, ...]:
    axes = variable.get_metadata().get(LOGICAL_AXES_KEY)
    if axes is None:
        shape = getattr(variable.get_value(), "shape", ())
        if len(shape) == 0:
            return ()
        raise ShardingError(
            f"parameter {path} (shape {tuple(shape)}) has no logical axes; annotate it in "
            f"the model with with_axes(init, (...))"
        )
    return tuple(axes)


def resolve_param(path: tuple, variable: nnx.Variable, rules: RuleTable,
                  mesh: Mesh) -> ParamSharding:
    """One Variable's resolved placement (errors name its path)."""
    name = path_str(path)
    value = variable.get_value()
    axes = logical_axes_of(variable, name)
    spec = logical_to_spec(axes, rules, dict(mesh.shape), shape=value.shape, path=name)
    return ParamSharding(name, tuple(value.shape), str(value.dtype), axes, spec)


def resolve_params(state: nnx.State, rules: RuleTable, mesh: Mesh) -> list[ParamSharding]:
    """Every Variable in `state` with its resolved spec, in a stable path order."""
    return [resolve_param(path, v, rules, mesh) for path, v in nnx.to_flat_state(state)]


def state_shardings(state: nnx.State, rules: RuleTable, mesh: Mesh) -> nnx.State:
    """An nnx.State of NamedShardings mirroring `state` (for jit out_shardings)."""
    return nnx.map_state(
        lambda path, v: v.replace(NamedSharding(mesh, resolve_param(path, v, rules, mesh).spec)),
        state)
