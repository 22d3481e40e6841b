"""What model files use: `with_axes` for parameters, `constrain` for activations.

Both speak logical names only. The mesh and rule table are bound from outside with
`activation_sharding(...)` while the step is traced; without it `constrain` is the
identity, so the same model runs eagerly on one device.

A model written for Flax annotates its parameters with `nnx.with_partitioning(init, names)`
instead; `annotated_axes` reads either annotation (spmd's `logical_axes` first, then Flax's
`out_sharding`, or `sharding_names` / `sharding` of older Flax), and the names go through
the same rules. A Flax spec shorter than the parameter's rank leaves the trailing dimensions
replicated, as in Flax; `annotated_axes` pads it with None and says how many it added.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from spmd.sharding.errors import ShardingError
from spmd.sharding.resolve import LogicalAxes, logical_to_spec
from spmd.sharding.rules import RuleTable

# Metadata key on nnx.Variable. Not Flax's own `out_sharding`: Flax would treat
# our logical names as mesh axes and shard eagerly.
LOGICAL_AXES_KEY = "logical_axes"

# Where Flax keeps `nnx.with_partitioning`'s names: `out_sharding` (Flax >= 0.12),
# `sharding_names` (0.10 - 0.11), `sharding` (older). Read as logical names, never as mesh axes.
FLAX_SHARDING_KEYS: tuple[str, ...] = ("out_sharding", "sharding_names", "sharding")


@dataclass(frozen=True)
class Annotation:
    """A parameter's logical axes, one per dimension, and where they came from."""

    axes: tuple[str | None, ...]
    source: str          # "with_axes" or the Flax metadata key ("out_sharding", ...)
    padded: int = 0      # trailing dimensions a short Flax spec left out (replicated)


def _flax_names(value: object, key: str, path: str) -> tuple[str | None, ...]:
    if isinstance(value, NamedSharding) or not isinstance(value, (tuple, list, PartitionSpec)):
        raise ShardingError(
            f"parameter {path}: Flax annotation {key}={value!r} is not a tuple of logical axis "
            f"names; annotate it with nnx.with_partitioning(init, ('embed', 'mlp', ...)) and "
            f"let the rules place it on the mesh"
        )
    names: list[str | None] = []
    for entry in value:
        if entry is None or entry is PartitionSpec.UNCONSTRAINED:
            names.append(None)
        elif isinstance(entry, str):
            names.append(entry)
        else:
            raise ShardingError(
                f"parameter {path}: Flax annotation {key}={tuple(value)!r} has the entry "
                f"{entry!r}; spmd takes one logical name (or None) per dimension"
            )
    return tuple(names)


def annotated_axes(metadata: dict, shape: tuple[int, ...], path: str) -> Annotation | None:
    """The logical axes that `with_axes` or `nnx.with_partitioning` gave a parameter (None:
    not annotated). A Flax spec shorter than `shape` is padded with None at the end."""
    axes = metadata.get(LOGICAL_AXES_KEY)
    if axes is not None:
        return Annotation(tuple(axes), "with_axes")
    for key in FLAX_SHARDING_KEYS:
        value = metadata.get(key)
        if value is None:
            continue
        names = _flax_names(value, key, path)
        padded = max(0, len(shape) - len(names))
        return Annotation(names + (None,) * padded, key, padded)
    return None


def with_axes(init: Callable, axes: LogicalAxes) -> Callable:
    """Wrap an initializer so the parameter it makes carries its logical axes."""
    return nnx.with_metadata(init, **{LOGICAL_AXES_KEY: tuple(axes)})


def param(rngs_key: jax.Array, init: Callable, shape, axes: LogicalAxes, dtype=None) -> nnx.Param:
    """A bare parameter with logical axes, for modules that build their own arrays."""
    value = init(rngs_key, shape, dtype) if dtype is not None else init(rngs_key, shape)
    return nnx.Param(value, **{LOGICAL_AXES_KEY: tuple(axes)})


@dataclass(frozen=True)
class _Binding:
    mesh: Mesh
    rules: RuleTable


_BINDING: contextvars.ContextVar[_Binding | None] = contextvars.ContextVar(
    "spmd_activation_sharding", default=None
)


@contextlib.contextmanager
def activation_sharding(mesh: Mesh, rules: RuleTable) -> Iterator[None]:
    """Bind the mesh and rules that `constrain` resolves against (while tracing)."""
    token = _BINDING.set(_Binding(mesh, rules))
    try:
        yield
    finally:
        _BINDING.reset(token)


def current_binding() -> _Binding | None:
    """The (mesh, rules) bound by `activation_sharding`, or None outside it."""
    return _BINDING.get()


def constrain(x: jax.Array, axes: LogicalAxes, name: str | None = None) -> jax.Array:
    """Pin an activation's sharding by logical names (identity when nothing is bound)."""
    binding = _BINDING.get()
    if binding is None:
        return x
    spec = logical_to_spec(
        axes, binding.rules, dict(binding.mesh.shape), shape=x.shape,
        path=name or "/".join(str(a) for a in axes), activation=True,
    )
    return jax.lax.with_sharding_constraint(x, NamedSharding(binding.mesh, spec))
