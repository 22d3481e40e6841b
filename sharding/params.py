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
    """`('layers', 0, 'mlp', 'up', 'kernel')` -> `layers/0/mlp/up/kernel`."""
    return "/".join(str(getattr(p, "key", getattr(p, "idx", p))) for p in path)


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


def resolve_params(state: nnx.State, rules: RuleTable, mesh: Mesh) -> list[ParamSharding]:
    """Every Variable in `state` with its resolved spec, in a stable path order."""
    out = []
    mesh_shape = dict(mesh.shape)
    for path, variable in nnx.to_flat_state(state):
        name = path_str(path)
        value = variable.get_value()
        axes = logical_axes_of(variable, name)
        spec = logical_to_spec(axes, rules, mesh_shape, shape=value.shape, path=name)
        out.append(ParamSharding(name, tuple(value.shape), str(value.dtype), axes, spec))
    return out


def state_shardings(state: nnx.State, rules: RuleTable, mesh: Mesh) -> nnx.State:
    """An nnx.State of NamedShardings mirroring `state` (for jit out_shardings)."""
    mesh_shape = dict(mesh.shape)

    def one(path, variable):
        name = path_str(path)
        axes = logical_axes_of(variable, name)
        value = variable.get_value()
        spec = logical_to_spec(axes, rules, mesh_shape, shape=value.shape, path=name)
        return variable.replace(NamedSharding(mesh, spec))

    return nnx.map_state(one, state)
