"""Shardings of an optimizer state: each moment sharded like the parameter it belongs to.

`optax.tree_map_params` finds the parts of the state that mirror the parameters. Most are
shaped like their parameter and take its sharding; a factored one (adafactor's row and
column statistics, a parameter's shape less one dimension) takes the parameter's spec less
that dimension's entry; any other shape (adafactor's 1-element placeholders) is replicated,
as are counters and everything that does not mirror the parameters. A part of the state
that covers only some parameters (muon's and `optax.masked`'s `MaskedNode` places) keeps
those places as they are.
"""

from __future__ import annotations

import math
from typing import Any

import optax
from jax.sharding import NamedSharding, PartitionSpec
from optax.transforms import MaskedNode


def fitted(shape: tuple[int, ...], param_shape: tuple[int, ...], sharding: Any,
           replicated: Any) -> Any:
    """The sharding of a state leaf of `shape` that belongs to a parameter of `param_shape`
    sharded by `sharding`."""
    shape, param_shape = tuple(shape), tuple(param_shape)
    if shape == param_shape:
        return sharding
    if not isinstance(sharding, NamedSharding) or len(shape) != len(param_shape) - 1:
        return replicated
    spec = tuple(sharding.spec) + (None,) * (len(param_shape) - len(sharding.spec))
    for dropped in range(len(param_shape)):
        if param_shape[:dropped] + param_shape[dropped + 1:] != shape:
            continue
        entries = spec[:dropped] + spec[dropped + 1:]
        if all(_divides(size, entry, sharding.mesh.shape) for size, entry in zip(shape, entries)):
            return NamedSharding(sharding.mesh, PartitionSpec(*entries))
    return replicated


def _divides(size: int, entry: Any, mesh_shape: Any) -> bool:
    if entry is None:
        return True
    axes = entry if isinstance(entry, tuple | list) else (entry,)
    return size % math.prod(mesh_shape[a] for a in axes) == 0


def opt_state_shardings(tx: optax.GradientTransformation, abstract_opt: Any,
                        param_shardings: Any, abstract_params: Any, replicated: Any) -> Any:
    """The shardings of `abstract_opt` (tx.init's abstract state) given the parameters'."""
    def one(leaf: Any, sharding: Any, param: Any) -> Any:
        if isinstance(leaf, MaskedNode):   # a parameter this part of the state leaves out
            return leaf
        return fitted(getattr(leaf, "shape", ()), getattr(param, "shape", ()), sharding,
                      replicated)

    return optax.tree_map_params(
        tx, one, abstract_opt, param_shardings, abstract_params,
        transform_non_params=lambda x: x if isinstance(x, MaskedNode) else replicated,
        is_leaf=lambda x: isinstance(x, MaskedNode),
    )
