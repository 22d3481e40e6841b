"""Train state created directly sharded: abstract init, then a jitted init with out_shardings.

The state is a typed pytree, `TrainState(step, params, opt_state)` with params as a pure
dict, so optax, Orbax and the partner copies all see ordinary arrays. No device ever
holds a full replica unless the rules say so. The data position is `step` itself: every
data source is a pure function of (seed, step).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from spmd.config.schema import TrainConfig
from spmd.sharding import RuleTable, ShardingReport, resolve_params, state_shardings
from spmd.tasks.base import Task


@flax.struct.dataclass
class TrainState:
    """What a checkpoint holds: updates done, parameters (pure dict), optimizer state."""

    step: Any
    params: Any
    opt_state: Any


def learning_rate(train: TrainConfig) -> optax.Schedule:
    """The learning-rate schedule: linear warm-up to `train.lr` over `train.warmup_steps`
    updates, then constant. One definition for the optimizer and for the `lr` that
    metrics.jsonl logs (update k, the one that makes step k, uses `schedule(k - 1)`)."""
    if train.warmup_steps:
        return optax.linear_schedule(0.0, train.lr, train.warmup_steps)
    return optax.constant_schedule(train.lr)


# optax.apply_if_finite applies a non-finite update after this many in a row; the trainer
# stops long before (train.max_skips), so in effect never.
_NEVER = 2**30


def make_optimizer(train: TrainConfig) -> optax.GradientTransformation:
    """AdamW on `learning_rate(train)` and optional global-norm clipping.

    With `train.nonfinite: skip`, wrapped in `optax.apply_if_finite`: a step whose gradients
    are not finite leaves parameters and optimizer state as they were, and the optimizer
    state counts skips (`skips`, `skips_in_a_row` in the step's metrics).
    """
    parts = [optax.clip_by_global_norm(train.grad_clip)] if train.grad_clip else []
    parts.append(optax.adamw(learning_rate(train), weight_decay=train.weight_decay))
    tx = optax.chain(*parts)
    if train.nonfinite == "skip":
        tx = optax.apply_if_finite(tx, max_consecutive_errors=_NEVER)
    return tx


@dataclass(frozen=True)
class ModelLayout:
    """What is known about a model before any array exists."""

    graphdef: nnx.GraphDef
    abstract_params: nnx.State      # nnx.State of ShapeDtypeStruct Variables, with logical axes
    report: ShardingReport

    def merge(self, params: dict) -> nnx.Module:
        """Rebuild the module from pure-dict params (inside jit: params are tracers)."""
        template = jax.tree.map(lambda x: x, self.abstract_params)
        nnx.replace_by_pure_dict(template, params)
        return nnx.merge(self.graphdef, template)


def model_layout(task: Task, seed: int, rules: RuleTable, mesh: Mesh) -> ModelLayout:
    """Trace the model's construction abstractly and resolve every parameter's sharding."""
    with nnx.use_eager_sharding(False):   # Flax-annotated models: spmd places the arrays
        abstract_model = nnx.eval_shape(lambda: task.build_model(nnx.Rngs(seed)))
    graphdef, abstract_params = nnx.split(abstract_model, nnx.Param)
    report = ShardingReport(dict(mesh.shape), resolve_params(abstract_params, rules, mesh))
    return ModelLayout(graphdef, abstract_params, report)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


@dataclass(frozen=True)
class StateLayout:
    """Shardings and abstract shapes of the whole train state."""

    shardings: TrainState         # of NamedShardings
    abstract: TrainState          # ShapeDtypeStructs carrying their shardings (restore targets)


def state_layout(layout: ModelLayout, tx: optax.GradientTransformation, rules: RuleTable,
                 mesh: Mesh) -> StateLayout:
    param_shardings = nnx.to_pure_dict(state_shardings(layout.abstract_params, rules, mesh))
    abstract_params = nnx.to_pure_dict(layout.abstract_params)
    abstract_opt = jax.eval_shape(tx.init, abstract_params)
    # Optimizer moments mirror their parameter's sharding; counters etc. are replicated.
    opt_shardings = optax.tree_map_params(
        tx, lambda _, s: s, abstract_opt, param_shardings,
        transform_non_params=lambda _: replicated(mesh),
    )
    shardings = TrainState(step=replicated(mesh), params=param_shardings,
                           opt_state=opt_shardings)
    abstract = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=abstract_params,
                          opt_state=abstract_opt)
    abstract = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
    )
    return StateLayout(shardings, abstract)


def init_state_fn(task: Task, seed: int, tx: optax.GradientTransformation,
                  layout: StateLayout) -> Callable[[], TrainState]:
    """A jitted initializer (model from `seed`, `train.seed`) whose outputs land directly in
    their shardings."""

    def init() -> TrainState:
        with nnx.use_eager_sharding(False):   # out_shardings place the arrays
            model = task.build_model(nnx.Rngs(seed))
        params = nnx.to_pure_dict(nnx.split(model, nnx.Param)[1])
        return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                          opt_state=tx.init(params))

    return jax.jit(init, out_shardings=layout.shardings)
