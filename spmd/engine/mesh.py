"""Build the named device mesh from config: sizes, the -1 absorber, hybrid node layout.

Every mesh has all six axes (size 1 when unused) so rule tables never name a
missing axis. On several nodes each axis size splits into an inter-node factor
and an intra-node factor; inter-node factors go on the outermost (slowest
network) axes first, and devices are grouped by the launcher's node ids, not by
process (one process per GPU is the common HPC layout, see jax#37769).

`mesh.axis_types` picks JAX's axis types: `auto` (the compiler propagates shardings) or
`explicit` (`AxisType.Explicit`: shardings are part of each array's type, as models written
for JAX's explicit sharding, like Flax's Gemma, expect). Such a model passes bare
`PartitionSpec`s (`out_sharding=P(...)`, `jax.sharding.reshard`), which JAX resolves against
the mesh set by `jax.set_mesh`; `set_mesh` cannot be entered inside `jax.jit`, so spmd enters
it around the jitted calls (`in_mesh`, `mesh_context`). In explicit mode the model's own
mesh-axis names resolve to themselves in the rule table (`physical_axis_rules`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from spmd.engine.engine_config import MeshConfig
from spmd.errors import ConfigError
from spmd.sharding import MESH_AXES, RuleTable, preset

AXIS_TYPES = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}


def mesh_axis_sizes(cfg: MeshConfig, num_devices: int) -> dict[str, int]:
    """Sizes of all mesh axes: preset defaults, then `mesh.axes`, one -1 absorbing the rest."""
    for name in cfg.axes:
        if name not in MESH_AXES:
            raise ConfigError(
                f"mesh.axes.{name}: not a mesh axis; mesh axes are {', '.join(MESH_AXES)}"
            )
    requested = {axis: 1 for axis in MESH_AXES}
    requested.update(preset(cfg.strategy).mesh_axes)
    requested.update(cfg.axes)
    # A preset's absorber yields to an explicit one from the config.
    explicit_absorbers = [a for a, s in cfg.axes.items() if s == -1]
    if explicit_absorbers:
        for axis, size in preset(cfg.strategy).mesh_axes.items():
            if size == -1 and axis not in cfg.axes:
                requested[axis] = 1
    absorbers = [a for a, s in requested.items() if s == -1]
    bad = [f"mesh.axes.{a}={s}" for a, s in requested.items() if s == 0 or s < -1]
    if bad:
        raise ConfigError(f"{', '.join(bad)}: mesh axis sizes must be positive or -1")
    if len(absorbers) > 1:
        raise ConfigError(
            f"mesh.axes: only one axis may be -1, got {', '.join(absorbers)}"
        )
    fixed = math.prod(s for s in requested.values() if s != -1)
    if absorbers:
        if num_devices % fixed:
            raise ConfigError(
                f"mesh.axes: the fixed sizes ({_fmt(requested)}) multiply to {fixed}, which does "
                f"not divide the {num_devices} devices; change mesh.axes"
            )
        requested[absorbers[0]] = num_devices // fixed
    elif fixed != num_devices:
        raise ConfigError(
            f"mesh.axes: sizes ({_fmt(requested)}) multiply to {fixed} but there are "
            f"{num_devices} devices; make the product {num_devices} or set one axis to -1"
        )
    return requested


def _fmt(sizes: Mapping[str, int]) -> str:
    return ", ".join(f"{a}={s}" for a, s in sizes.items() if s != 1) or "all 1"


@dataclass(frozen=True)
class HybridLayout:
    """Per-axis inter-node (across nodes) and intra-node factors."""

    sizes: dict[str, int]
    inter_node: dict[str, int]
    intra_node: dict[str, int]


def hybrid_layout(sizes: Mapping[str, int], num_nodes: int) -> HybridLayout:
    """Place the node count on the outermost axes that it divides into."""
    remaining = num_nodes
    inter, intra = {}, {}
    for axis in MESH_AXES:
        factor = math.gcd(sizes[axis], remaining)
        inter[axis], intra[axis] = factor, sizes[axis] // factor
        remaining //= factor
    if remaining != 1:
        raise ConfigError(
            f"mesh.axes ({_fmt(sizes)}) cannot be laid out over {num_nodes} nodes: the node "
            f"count must factor into the axis sizes, outer axes first; change mesh.axes"
        )
    return HybridLayout(dict(sizes), inter, intra)


def _devices_by_node(devices: Sequence[jax.Device], node_of_process: Sequence[int] | None):
    node_of = (lambda d: node_of_process[d.process_index]) if node_of_process else (lambda d: 0)
    nodes: dict[int, list[jax.Device]] = {}
    for d in sorted(devices, key=lambda d: (node_of(d), d.process_index, d.id)):
        nodes.setdefault(node_of(d), []).append(d)
    groups = list(nodes.values())
    if len({len(g) for g in groups}) != 1:
        counts = {n: len(g) for n, g in nodes.items()}
        raise ConfigError(f"nodes have different device counts {counts}; a mesh needs equal nodes")
    return groups


def build_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None,
               node_of_process: Sequence[int] | None = None) -> Mesh:
    """The mesh over `devices` (default: all), hybrid across the nodes given by the launcher."""
    devices = list(devices if devices is not None else jax.devices())
    groups = _devices_by_node(devices, node_of_process)
    sizes = mesh_axis_sizes(cfg, len(devices))
    layout = hybrid_layout(sizes, len(groups))
    # (node, device-in-node) -> (inter factors..., intra factors...) -> interleave per axis.
    grid = np.array(groups, dtype=object).reshape(
        [layout.inter_node[a] for a in MESH_AXES] + [layout.intra_node[a] for a in MESH_AXES]
    )
    n = len(MESH_AXES)
    order = [i for pair in zip(range(n), range(n, 2 * n)) for i in pair]
    grid = grid.transpose(order).reshape([sizes[a] for a in MESH_AXES])
    return Mesh(grid, MESH_AXES, axis_types=(AXIS_TYPES[cfg.axis_types],) * n)


def is_explicit(mesh: Any) -> bool:
    """Whether any axis of `mesh` (a Mesh or an AbstractMesh) is `AxisType.Explicit`."""
    return any(t == AxisType.Explicit for t in getattr(mesh, "axis_types", ()) or ())


def mesh_context(mesh: Mesh) -> contextlib.AbstractContextManager:
    """`jax.set_mesh(mesh)` for an explicit mesh (bare PartitionSpecs resolve against it);
    nothing for an auto mesh, whose programs name their NamedShardings in full."""
    return jax.set_mesh(mesh) if is_explicit(mesh) else contextlib.nullcontext()


def abstract_mesh_context(mesh: Mesh) -> contextlib.AbstractContextManager:
    """`jax.sharding.use_abstract_mesh(mesh.abstract_mesh)` for an explicit mesh (nothing
    for an auto one): unlike `jax.set_mesh`, it may be entered inside a jitted function,
    where bare PartitionSpecs then resolve against it (used by `spmd export`)."""
    if not is_explicit(mesh):
        return contextlib.nullcontext()
    return jax.sharding.use_abstract_mesh(mesh.abstract_mesh)


class InMesh:
    """A jitted function called and lowered under `jax.set_mesh(mesh)`: tracing happens at
    the first call or at `lower`, and a model with `out_sharding=P(...)` needs the mesh
    then. Every other attribute is the jitted function's."""

    def __init__(self, fn: Callable, mesh: Mesh):
        self.fn, self.mesh = fn, mesh

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with jax.set_mesh(self.mesh):
            return self.fn(*args, **kwargs)

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        with jax.set_mesh(self.mesh):
            return self.fn.lower(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name in ("fn", "mesh"):   # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.fn, name)


def in_mesh(fn: Callable | None, mesh: Mesh) -> Callable | None:
    """`fn` wrapped in `InMesh` on an explicit mesh; `fn` itself on an auto mesh."""
    return InMesh(fn, mesh) if fn is not None and is_explicit(mesh) else fn


def physical_axis_rules(rules: RuleTable, cfg: MeshConfig) -> RuleTable:
    """Under `mesh.axis_types: explicit`, each mesh axis name that has no rule of its own
    maps to itself: a model written for explicit sharding annotates its parameters with
    PartitionSpecs of mesh-axis names (Gemma's `ShardingConfig`), and those place the
    parameters as written. Logical names keep going through the table. Under `auto`, the
    table is returned unchanged (a name must have a rule)."""
    if cfg.axis_types != "explicit":
        return rules
    return rules.with_overrides({a: a for a in MESH_AXES if rules.lookup(a) is None})
