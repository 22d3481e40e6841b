"""Train state created directly sharded: abstract init, then a jitted init with out_shardings.

The state is a typed pytree, `TrainState(step, params, opt_state, rng)` with params as a
pure dict and `rng` the raw uint32 data of a key (replicated), so optax, Orbax and the
partner copies all see ordinary arrays. No device ever holds a full replica unless the
rules say so. The data position is `step` itself: every data source is a pure function of
(seed, step). So is the randomness: `rng` is set once from `train.seed` (`train_rng`) and
never changes; update k draws from `step_key(rng, k)` (`fold_in` of the step), split per
purpose (`step_rngs`: the task's dropout and default streams, the model's own RNG
variables), so a resumed run draws exactly what an uninterrupted one would.

A model's variables are its parameters (`nnx.Param`) and, optionally, RNG streams that its
modules hold (`nnx.Dropout(rate, rngs=rngs)` keeps an `nnx.RngKey` and `nnx.RngCount`):
those are not state, `ModelLayout.merge` fills them from the step's key, per variable path.
Any other variable type (batch statistics, caches) is refused by `model_layout`, naming it.
"""

from __future__ import annotations

import dataclasses
import zlib
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
from spmd.errors import SpmdError
from spmd.sharding import RuleTable, ShardingReport, resolve_params, state_shardings
from spmd.tasks.base import Task


@flax.struct.dataclass
class TrainState:
    """What a checkpoint holds: updates done, parameters (pure dict), optimizer state, and
    the run's base RNG key as raw uint32 key data (`jax.random.key_data`; constant: the
    key of update k is `step_key(rng, k)`)."""

    step: Any
    params: Any
    opt_state: Any
    rng: Any = None   # last: a checkpoint written before it existed has none (`train_rng`)


# Fields of TrainState that checkpoints written by an earlier spmd lack (restored as None,
# then filled: spmd.loop.trainer.fill_missing).
ADDED_FIELDS = ("rng",)

# Purposes a step's key is split into (fold_in constants; fixed: changing them changes runs).
_TRAIN_STREAM, _TASK_DEFAULT, _TASK_DROPOUT, _MODEL_RNGS, _EVAL_STREAM = range(1, 6)


def train_rng(seed: int) -> jax.Array:
    """The run's base key from `train.seed`, as raw key data (what `TrainState.rng` holds).

    Distinct from the key the parameters are initialized from (`nnx.Rngs(seed)`)."""
    return jax.random.key_data(jax.random.fold_in(jax.random.key(seed), _TRAIN_STREAM))


def abstract_rng() -> jax.ShapeDtypeStruct:
    """Shape and dtype of `TrainState.rng` under the default PRNG implementation."""
    return jax.eval_shape(lambda: train_rng(0))


def step_key(rng: jax.Array, step: jax.Array | int) -> jax.Array:
    """The key of update `step` (counted from 0: the update that makes step + 1): a pure
    function of (rng, step)."""
    return jax.random.fold_in(jax.random.wrap_key_data(rng), step)


def eval_key(rng: jax.Array) -> jax.Array:
    """The fixed key evaluation draws from (eval mode needs none; a task may ask)."""
    return jax.random.fold_in(jax.random.wrap_key_data(rng), _EVAL_STREAM)


def task_rngs(key: jax.Array) -> nnx.Rngs:
    """The `rngs` a task's loss or eval_metrics receives: streams `dropout` and `default`
    (any other stream name falls back to `default`), from one step's key."""
    return nnx.Rngs(default=jax.random.fold_in(key, _TASK_DEFAULT),
                    dropout=jax.random.fold_in(key, _TASK_DROPOUT))


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
    # the RNG streams the model's modules hold (nnx.RngKey/RngCount), abstract; often empty
    abstract_rngs: nnx.State = dataclasses.field(default_factory=lambda: nnx.State({}))

    def merge(self, params: dict, key: jax.Array | None = None, *,
              train: bool = False) -> nnx.Module:
        """Rebuild the module from pure-dict params (inside jit: params are tracers), in
        train mode (`model.train()`: Dropout active) or eval mode (`model.eval()`).

        RNG streams the model holds get a key derived from `key` and the variable's path,
        and a count of 0 (as `nnx.reseed` would): deterministic per (key, path). No `key`:
        a fixed one (eval mode draws nothing from it).
        """
        template = jax.tree.map(lambda x: x, self.abstract_params)
        nnx.replace_by_pure_dict(template, params)
        states = [template]
        if len(nnx.to_flat_state(self.abstract_rngs)):
            states.append(model_rng_state(self.abstract_rngs,
                                          jax.random.key(0) if key is None else key))
        model = nnx.merge(self.graphdef, *states)
        if train:
            model.train()
        else:
            model.eval()
        return model


def model_rng_state(abstract: nnx.State, key: jax.Array) -> nnx.State:
    """Concrete RNG-stream variables for `abstract` (RngKey: `key` folded with the crc32 of
    the variable's path, split to its shape; RngCount: zeros)."""
    base = jax.random.fold_in(key, _MODEL_RNGS)
    flat = []
    for path, variable in nnx.to_flat_state(abstract):
        shape = tuple(variable.get_value().shape)
        if isinstance(variable, nnx.RngKey):
            k = jax.random.fold_in(base, zlib.crc32("/".join(map(str, path)).encode()))
            value = jax.random.split(k, shape) if shape else k
        else:
            value = jnp.zeros(shape, variable.get_value().dtype)
        flat.append((path, variable.replace(value)))
    return nnx.from_flat_state(flat)


def model_layout(task: Task, seed: int, rules: RuleTable, mesh: Mesh) -> ModelLayout:
    """Trace the model's construction abstractly and resolve every parameter's sharding.

    Variables besides parameters and RNG streams are refused with the path and type of the
    first few: spmd's train state has no place for them (yet)."""
    with nnx.use_eager_sharding(False):   # Flax-annotated models: spmd places the arrays
        abstract_model = nnx.eval_shape(lambda: task.build_model(nnx.Rngs(seed)))
    graphdef, abstract_params, abstract_rngs, other = nnx.split(
        abstract_model, nnx.Param, nnx.RngState, ...)
    unsupported = list(nnx.to_flat_state(other))
    if unsupported:
        shown = ", ".join(f"{'/'.join(map(str, path))} ({type(v).__name__})"
                          for path, v in unsupported[:5])
        more = f" and {len(unsupported) - 5} more" if len(unsupported) > 5 else ""
        raise SpmdError(
            f"task {type(task).__name__}: the model holds variables that are neither "
            f"parameters (nnx.Param) nor RNG streams (nnx.RngKey/RngCount, e.g. "
            f"nnx.Dropout(rate, rngs=rngs)): {shown}{more}. spmd trains parameters and "
            f"fills RNG streams from the step's key; other variable types (batch statistics "
            f"such as nnx.BatchNorm's, caches) are not part of its train state: use a "
            f"normalization without running statistics (nnx.LayerNorm, nnx.GroupNorm), or "
            f"make these nnx.Param if they are trained")
    report = ShardingReport(dict(mesh.shape), resolve_params(abstract_params, rules, mesh))
    return ModelLayout(graphdef, abstract_params, report, abstract_rngs)


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
                           opt_state=opt_shardings, rng=replicated(mesh))
    abstract = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=abstract_params,
                          opt_state=abstract_opt, rng=abstract_rng())
    abstract = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
    )
    return StateLayout(shardings, abstract)


def init_state_fn(task: Task, seed: int, tx: optax.GradientTransformation,
                  layout: StateLayout) -> Callable[[], TrainState]:
    """A jitted initializer (model and RNG key from `seed`, `train.seed`) whose outputs land
    directly in their shardings."""

    def init() -> TrainState:
        with nnx.use_eager_sharding(False):   # out_shardings place the arrays
            model = task.build_model(nnx.Rngs(seed))
        params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                          opt_state=tx.init(params), rng=train_rng(seed))

    return jax.jit(init, out_shardings=layout.shardings)
