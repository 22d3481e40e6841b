"""What model files use: `with_axes` for parameters, `constrain` for activations.

Both speak logical names only. The mesh and rule table are bound from outside with
`activation_sharding(...)` while the step is traced; without it `constrain` is the
identity, so the same model runs eagerly on one device.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from spmd.sharding.resolve import LogicalAxes, logical_to_spec
from spmd.sharding.rules import RuleTable

# Metadata key on nnx.Variable. Not Flax's own `out_sharding`: Flax would treat
# our logical names as mesh axes and shard eagerly.
LOGICAL_AXES_KEY = "logical_axes"


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
