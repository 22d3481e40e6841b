"""Resolve a whole parameter tree (an nnx.State of Variables) to shardings.

Each parameter's logical axes come from `with_axes` or Flax's `nnx.with_partitioning`
(`annotate.annotated_axes`; a parameter with neither gets one unnamed `None` per dimension
and is marked `unannotated`, unless the table says `require_annotations`), go through the
rule table (`resolve.logical_to_spec`), and then,
when the mesh has an `fsdp` axis and the table an `fsdp_min_bytes`, through auto-FSDP
(`fsdp.auto_fsdp_dim`). `resolve_param` is the one place that does this, for the report, the
train state, the optimizer moments and restore targets alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from spmd.sharding.annotate import annotated_axes
from spmd.sharding.errors import ShardingError
from spmd.sharding.fsdp import auto_fsdp_dim, with_fsdp_on
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
    logical_axes: tuple[str | None, ...]   # one per dimension (a short Flax spec padded)
    spec: PartitionSpec
    padded: int = 0                        # trailing dims a short Flax spec left out (None)
    auto_fsdp_dim: int | None = None       # dim auto-FSDP put on fsdp; None: the rules decided
    unannotated: bool = False              # the model gave it no logical axes (all None here)

    def bytes_total(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    def bytes_per_device(self, mesh_shape: dict[str, int]) -> int:
        ways = 1
        for entry in self.spec:
            for axis in (entry,) if isinstance(entry, str) else (entry or ()):
                ways *= mesh_shape[axis]
        return self.bytes_total() // ways


def logical_axes_of(variable: nnx.Variable, path: str,
                    require_annotations: bool = False) -> tuple[str | None, ...]:
    """The parameter's logical axes, one per dimension (see `annotate.annotated_axes`); an
    unannotated one: all None (an error with `require_annotations`)."""
    return _annotation(variable, path, require_annotations)[0]


def _annotation(variable: nnx.Variable, path: str,
                require_annotations: bool) -> tuple[tuple[str | None, ...], int, bool]:
    """(logical axes, padded dims, unannotated) of one parameter."""
    shape = tuple(getattr(variable.get_value(), "shape", ()))
    found = annotated_axes(variable.get_metadata(), shape, path)
    if found is not None:
        return found.axes, found.padded, False
    if len(shape) == 0:
        return (), 0, False
    if require_annotations:
        raise ShardingError(
            f"parameter {path} (shape {shape}) has no logical axes, and "
            f"mesh.require_annotations=true refuses that; annotate it in the model with "
            f"spmd's with_axes(init, (...)) or Flax's nnx.with_partitioning(init, (...)), "
            f"one logical name (or None) per dimension, or set mesh.require_annotations=false "
            f"to replicate it (auto-FSDP places it under fsdp)"
        )
    return (None,) * len(shape), 0, True


def resolve_param(path: tuple, variable: nnx.Variable, rules: RuleTable,
                  mesh: Mesh) -> ParamSharding:
    """One Variable's resolved placement (errors name its path)."""
    name = path_str(path)
    value = variable.get_value()
    shape = tuple(value.shape)
    axes, padded, unannotated = _annotation(variable, name, rules.require_annotations)
    mesh_shape = dict(mesh.shape)
    spec = logical_to_spec(axes, rules, mesh_shape, shape=shape, path=name)
    dim = auto_fsdp_dim(shape, value.dtype, spec, axes, mesh_shape, rules.fsdp_min_bytes)
    if dim is not None:
        spec = with_fsdp_on(spec, len(shape), dim)
    return ParamSharding(name, shape, str(value.dtype), axes, spec, padded, dim, unannotated)


def resolve_params(state: nnx.State, rules: RuleTable, mesh: Mesh) -> list[ParamSharding]:
    """Every Variable in `state` with its resolved spec, in a stable path order."""
    return [resolve_param(path, v, rules, mesh) for path, v in nnx.to_flat_state(state)]


def state_shardings(state: nnx.State, rules: RuleTable, mesh: Mesh) -> nnx.State:
    """An nnx.State of NamedShardings mirroring `state` (for jit out_shardings)."""
    return nnx.map_state(
        lambda path, v: v.replace(NamedSharding(mesh, resolve_param(path, v, rules, mesh).spec)),
        state)
