"""Train state created directly sharded: abstract init, then a jitted init with out_shardings.

The state is a typed pytree, `TrainState(step, params, opt_state, rng, ema)` with params as
a pure dict and `rng` the raw uint32 data of a key (replicated), so optax, Orbax and the
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

`train.ema_decay` d adds `ema`, an exponential moving average of the parameters: it starts
as a copy of the initial parameters and after every update becomes d * ema + (1 - d) *
params (`update_ema`). Starting from the parameters rather than from zeros needs no
debiasing (optax.ema's `debias` corrects a zero start). It is float32 for parameters stored
in fewer bits, sharded like the parameters, checkpointed and resharded with them.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from spmd.engine import model_errors
from spmd.engine.engine_config import EngineSections
from spmd.engine.executables import compile_or_load
from spmd.engine.mesh import is_explicit, mesh_context
from spmd.errors import ConfigError, SpmdError
from spmd.optim import build_optimizer, build_schedule, decay_mask, with_clipping
from spmd.optim.state_sharding import opt_state_shardings
from spmd.sharding import (
    RuleTable,
    ShardingError,
    ShardingReport,
    annotated_axes,
    resolve_params,
    state_shardings,
)
from spmd.tasks.base import Task


@flax.struct.dataclass
class TrainState:
    """What a checkpoint holds: updates done, parameters (pure dict), optimizer state, and
    the run's base RNG key as raw uint32 key data (`jax.random.key_data`; constant: the
    key of update k is `step_key(rng, k)`)."""

    step: Any
    params: Any
    opt_state: Any
    rng: Any = None   # a checkpoint written before it existed has none (`train_rng`)
    # `train.ema_decay`: an exponential moving average of the parameters (float32, sharded
    # like them); None when the EMA is off. A checkpoint without one fills it from the params.
    ema: Any = None


# Fields of TrainState that a checkpoint may lack (written by an earlier spmd, or before the
# EMA was switched on): restored as None, then filled (spmd.loop.recipe.fill_missing).
ADDED_FIELDS = ("rng", "ema")

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


def learning_rate(sections: EngineSections) -> optax.Schedule:
    """The learning-rate schedule: `schedule` (spmd.optim.schedules) peaking at
    `optimizer.lr`, over `train.steps`. One definition for the optimizer and for the `lr`
    that metrics.jsonl logs (update k, the one that makes step k, uses `schedule(k - 1)`)."""
    return build_schedule(sections.schedule, sections.optimizer.lr, sections.train.steps)


# optax.apply_if_finite applies a non-finite update after this many in a row; the trainer
# stops long before (train.max_skips), so in effect never.
_NEVER = 2**30


def make_optimizer(sections: EngineSections, task: Task | None = None,
                   layout: ModelLayout | None = None) -> optax.GradientTransformation:
    """The `optimizer:` section's update rule on `learning_rate(sections)` (or the task's own,
    `Task.optimizer`), after global-norm clipping (`optimizer.grad_clip`).

    Weight decay applies where `optimizer.no_decay` says (spmd.optim.optimizers), judged by
    each parameter's path and, from `layout`'s sharding report, its logical axes.
    With `train.nonfinite: skip`, wrapped in `optax.apply_if_finite`: a step whose gradients
    are not finite leaves parameters and optimizer state as they were, and the optimizer
    state counts skips (`skips`, `skips_in_a_row` in the step's metrics).
    """
    schedule = learning_rate(sections)
    tx = task.optimizer(schedule) if task is not None else None
    if tx is None:
        axes = ({p.path: tuple(p.logical_axes) for p in layout.report.params}
                if layout is not None else None)
        try:
            tx = build_optimizer(sections.optimizer, schedule,
                                 decay_mask(sections.optimizer.no_decay, axes))
        except ValueError as e:
            raise ConfigError(str(e)) from None
    elif not isinstance(tx, optax.GradientTransformation):
        raise ConfigError(f"task {type(task).__name__}: optimizer() returned "
                          f"{type(tx).__name__}, not an optax.GradientTransformation (or None)")
    tx = with_clipping(tx, sections.optimizer.grad_clip)
    if sections.train.nonfinite == "skip":
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
    # the task's mode hooks (`Task.train_mode`, `Task.eval_mode`); None: model.train()/eval()
    train_mode: Callable[[nnx.Module], None] | None = None
    eval_mode: Callable[[nnx.Module], None] | None = None
    task_name: str = "Task"   # for framed model errors (spmd.engine.model_errors)

    def merge(self, params: dict, key: jax.Array | None = None, *,
              train: bool = False) -> nnx.Module:
        """Rebuild the module from pure-dict params (inside jit: params are tracers), in
        train mode (`Task.train_mode`, default `model.train()`: Dropout active) or eval mode
        (`Task.eval_mode`, default `model.eval()`).

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
        hook = self.train_mode if train else self.eval_mode
        if hook is not None:
            with model_errors.framed("train_mode" if train else "eval_mode", self.task_name):
                hook(model)
        elif train:
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
    name = type(task).__name__
    with (nnx.use_eager_sharding(False),   # Flax-annotated models: spmd places the arrays
          mesh_context(mesh),              # mesh.axis_types=explicit: under jax.set_mesh
          model_errors.framed("build", name)):
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
    if is_explicit(mesh):
        check_mesh_axis_names(abstract_params, rules, mesh)
    report = ShardingReport(dict(mesh.shape), resolve_params(abstract_params, rules, mesh))
    return ModelLayout(graphdef, abstract_params, report, abstract_rngs,
                       getattr(task, "train_mode", None), getattr(task, "eval_mode", None),
                       name)


def check_mesh_axis_names(abstract_params: nnx.State, rules: RuleTable, mesh: Mesh) -> None:
    """On an explicit mesh, every name in a parameter's annotation is a logical name with a
    rule or one of the mesh's axes; otherwise a `ShardingError` names the parameter, the
    name and the mesh's axes (a model written for another mesh, e.g. Gemma's default
    tensor-parallel axis 'tp', where spmd's mesh calls it 'tensor')."""
    names = tuple(mesh.axis_names)
    for path, variable in nnx.to_flat_state(abstract_params):
        where = "/".join(map(str, path))
        found = annotated_axes(variable.get_metadata(),
                               tuple(getattr(variable.get_value(), "shape", ())), where)
        for axis in found.axes if found is not None else ():
            if axis is None or rules.lookup(axis) is not None or axis in names:
                continue
            raise ShardingError(
                f"parameter {where}: its sharding {tuple(found.axes)} names '{axis}', which is "
                f"neither a mesh axis ({', '.join(names)}) nor a logical axis with a "
                f"rule. Under mesh.axis_types=explicit a model's PartitionSpecs name the mesh's "
                f"axes directly: build the model with spmd's axis names (e.g. a ShardingConfig "
                f"made with tensor_parallel_axis_name='tensor'), or map the name with "
                f"mesh.rules.{axis}=tensor (parameters only; activations' out_sharding must "
                f"name mesh axes)")


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


@dataclass(frozen=True)
class StateLayout:
    """Shardings and abstract shapes of the whole train state."""

    shardings: TrainState         # of NamedShardings
    abstract: TrainState          # ShapeDtypeStructs carrying their shardings (restore targets)


def ema_dtype(dtype: Any) -> Any:
    """The EMA's dtype for a parameter of `dtype`: float32 for floating parameters stored in
    fewer bits (an average of small steps needs the mantissa), else the parameter's own."""
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4:
        return jnp.dtype(jnp.float32)
    return dtype


def init_ema(params: Any) -> Any:
    """The EMA's starting value: a copy of the parameters (no zero start, so no debiasing)."""
    return jax.tree.map(lambda p: p.astype(ema_dtype(p.dtype)), params)


def update_ema(ema: Any, params: Any, decay: float) -> Any:
    """ema <- decay * ema + (1 - decay) * params, in the EMA's dtype (float32)."""
    return jax.tree.map(lambda e, p: decay * e + (1.0 - decay) * p.astype(e.dtype), ema, params)


def ema_as_params(ema: Any, abstract_params: Any) -> Any:
    """The EMA cast back to the parameters' dtypes (what the model is merged with)."""
    return jax.tree.map(lambda e, a: e.astype(a.dtype), ema, abstract_params)


def fill_ema(state: TrainState, shardings: TrainState) -> TrainState:
    """`state` whose missing EMA (a checkpoint without one) starts from its parameters."""
    ema = jax.jit(init_ema, out_shardings=shardings.ema)(state.params)
    return state.replace(ema=ema)


def state_layout(layout: ModelLayout, tx: optax.GradientTransformation, rules: RuleTable,
                 mesh: Mesh, *, ema: bool = False) -> StateLayout:
    """`ema`: the state keeps an EMA of the parameters (`train.ema_decay`), sharded like
    them."""
    param_shardings = nnx.to_pure_dict(state_shardings(layout.abstract_params, rules, mesh))
    abstract_params = nnx.to_pure_dict(layout.abstract_params)
    abstract_opt = jax.eval_shape(tx.init, abstract_params)
    # Optimizer moments mirror their parameter's sharding (a factored moment: its fit, see
    # spmd.optim.state_sharding); counters etc. are replicated.
    opt_shardings = opt_state_shardings(tx, abstract_opt, param_shardings, abstract_params,
                                        replicated(mesh))
    shardings = TrainState(step=replicated(mesh), params=param_shardings,
                           opt_state=opt_shardings, rng=replicated(mesh),
                           ema=param_shardings if ema else None)
    abstract = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=abstract_params,
                          opt_state=abstract_opt, rng=abstract_rng(),
                          ema=jax.eval_shape(init_ema, abstract_params) if ema else None)
    abstract = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
    )
    return StateLayout(shardings, abstract)


def run_once_options() -> dict[str, int]:
    """XLA options for a program that runs once (the initializer): LLVM's optimisation level
    1, not XLA's default 2, which buys nothing for one call and costs most of its compile
    time (CPU: the FNO's and the tiny transformer's initializers, 3.5 s -> 1.3 s; the same
    bits, checked on both). An optimisation level the user set in XLA_FLAGS stays theirs."""
    if "xla_backend_optimization_level" in os.environ.get("XLA_FLAGS", ""):
        return {}
    return {"xla_backend_optimization_level": 1}


def init_state_fn(task: Task, seed: int, tx: optax.GradientTransformation,
                  layout: StateLayout) -> Callable[[], TrainState]:
    """A jitted initializer (model and RNG key from `seed`, `train.seed`) whose outputs land
    directly in their shardings; the EMA (when the layout has one) starts at the params."""
    with_ema = layout.shardings.ema is not None

    def init() -> TrainState:
        with (nnx.use_eager_sharding(False),   # out_shardings place the arrays
              model_errors.framed("init", type(task).__name__)):
            model = task.build_model(nnx.Rngs(seed))
        params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                          opt_state=tx.init(params), rng=train_rng(seed),
                          ema=init_ema(params) if with_ema else None)

    jitted = jax.jit(init, out_shardings=layout.shardings)

    @functools.cache   # compiled (or loaded) on the first call, kept for more
    def compiled(shared: Path | None) -> Callable[[], TrainState]:
        executable, _ = compile_or_load(jitted.lower(), None, jax.process_index(),
                                        shared=shared, compiler_options=run_once_options())
        return executable

    def init_once(shared: Path | None = None) -> TrainState:
        """The initial state; `shared`: spmd.engine.executables.shared_store(), where this
        rank's compiled initializer is loaded from or kept (None: compiled)."""
        return compiled(shared)()

    init_once.jitted = jitted   # compiled with XLA's defaults when called (a test compares)
    return init_once
