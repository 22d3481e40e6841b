"""The one resolver: logical axis names -> PartitionSpec, for parameters and activations.

Strict by design: a name without a rule, a mesh axis used twice, or a dimension that
its mesh axes do not divide is an error naming the parameter path, never a silent
replication.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from jax.sharding import PartitionSpec

from spmd.sharding.axes import ACTIVATION_PREFIX
from spmd.sharding.errors import ShardingError
from spmd.sharding.rules import MeshAxes, RuleTable

LogicalAxes = Sequence[str | None]


def _lookup(rules: RuleTable, name: str, activation: bool, where: str) -> MeshAxes:
    if activation:
        found = rules.lookup(ACTIVATION_PREFIX + name)
        if found is not None:
            return found
    found = rules.lookup(name)
    if found is None:
        raise ShardingError(
            f"{where}: logical axis '{name}' has no rule; add it to mesh.rules "
            f"(e.g. mesh.rules.{name}=null to replicate it)"
        )
    return found


def logical_to_spec(
    logical_axes: LogicalAxes,
    rules: RuleTable,
    mesh_shape: Mapping[str, int],
    *,
    shape: Sequence[int] | None = None,
    path: str = "<array>",
    activation: bool = False,
) -> PartitionSpec:
    """Resolve one array's logical axes to a PartitionSpec on a mesh of `mesh_shape`.

    Mesh axes of size 1 are dropped from the spec (they shard nothing); `None` in
    `logical_axes` means this dimension is deliberately replicated.
    """
    kind = "activation" if activation else "parameter"
    where = f"{kind} {path}"
    if shape is not None and len(shape) != len(logical_axes):
        raise ShardingError(
            f"{where}: has {len(shape)} dimensions {tuple(shape)} but {len(logical_axes)} "
            f"logical axes {tuple(logical_axes)}"
        )
    used: dict[str, str] = {}
    entries: list[str | tuple[str, ...] | None] = []
    for dim, name in enumerate(logical_axes):
        if name is None:
            entries.append(None)
            continue
        mesh_axes = _lookup(rules, name, activation, where)
        for axis in mesh_axes:
            if axis not in mesh_shape:
                raise ShardingError(
                    f"{where}: rule '{name}' -> '{axis}' names a mesh axis that does not exist; "
                    f"mesh axes are {', '.join(mesh_shape)}"
                )
            if axis in used:
                raise ShardingError(
                    f"{where}: mesh axis '{axis}' is used twice, by logical axes "
                    f"'{used[axis]}' and '{name}'; change mesh.rules so each mesh axis "
                    f"shards at most one dimension"
                )
            used[axis] = name
        active = tuple(a for a in mesh_axes if mesh_shape[a] > 1)
        if shape is not None and active:
            ways = 1
            for a in active:
                ways *= mesh_shape[a]
            if shape[dim] % ways:
                sizes = ", ".join(f"{a}={mesh_shape[a]}" for a in active)
                raise ShardingError(
                    f"{where}: dimension {dim} ('{name}') has size {shape[dim]}, which is not "
                    f"divisible by its mesh axes ({sizes}, {ways} ways); change the model size "
                    f"or mesh.axes, or mesh.rules.{name}"
                )
        if not active:
            entries.append(None)
        elif len(active) == 1:
            entries.append(active[0])
        else:
            entries.append(active)
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)


def spec_is_replicated(spec: PartitionSpec) -> bool:
    return all(e is None for e in spec)
