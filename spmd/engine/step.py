"""The jitted train and eval steps: explicit in/out shardings, donated state.

Training runs the model in train mode (`Task.train_mode`, default `model.train()`: Dropout
active), evaluation and samples in eval mode (`Task.eval_mode`, default `model.eval()`), each
step's randomness drawn from the state's key and
the step (spmd.engine.state: `step_key`). A task's `loss` and `eval_metrics` may take
keyword arguments `rngs` (an `nnx.Rngs` with `dropout` and `default` streams) and `train`;
`task_options` finds out once which ones, and only those are passed. An exception from the
task's model while a step is traced is framed with the stage and the task
(spmd.engine.model_errors).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from spmd.engine.mesh import is_explicit
from spmd.engine.model_errors import framed
from spmd.engine.state import (
    ModelLayout,
    StateLayout,
    TrainState,
    eval_key,
    replicated,
    step_key,
    task_rngs,
    train_rng,
    update_ema,
)
from spmd.sharding import RuleTable, activation_sharding
from spmd.sharding.pipeline import PipelineSchedule, pipeline_schedule
from spmd.tasks.base import Task

OPTIONS = ("rngs", "train")  # optional keyword arguments of Task.loss / Task.eval_metrics


def task_options(method: Callable) -> frozenset[str]:
    """Which of `OPTIONS` a task method accepts by keyword: parameters named so (keyword or
    positional-or-keyword), or all of them when it takes `**kwargs`. A method whose
    signature cannot be read takes none (the 2-argument form)."""
    try:
        params = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):
        return frozenset()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return frozenset(OPTIONS)
    return frozenset(p.name for p in params if p.name in OPTIONS and p.kind in (
        inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD))


def with_options(method: Callable) -> Callable[..., object]:
    """`method(model, batch, rngs=..., train=...)` passing only what it accepts (looked up
    once, here); `rngs` is built lazily from a key, and only when the method takes it."""
    accepted = task_options(method)

    def call(model, batch, *, key: jax.Array, train: bool):
        kwargs: dict = {}
        if "rngs" in accepted:
            kwargs["rngs"] = task_rngs(key)
        if "train" in accepted:
            kwargs["train"] = train
        return method(model, batch, **kwargs)

    return call


def constrained(x, sharding: NamedSharding):
    """`x` laid out as `sharding` (a pytree of them for a pytree `x`): a sharding constraint
    on an auto mesh, `jax.sharding.reshard` on an explicit one (where
    `with_sharding_constraint` only asserts the layout an array already has)."""
    leaves = jax.tree.leaves(sharding, is_leaf=lambda s: isinstance(s, NamedSharding))
    if leaves and is_explicit(leaves[0].mesh):
        return jax.sharding.reshard(x, sharding)
    return jax.lax.with_sharding_constraint(x, sharding)


def split_microbatches(batch: dict, batch_shardings: Mapping[str, NamedSharding], k: int,
                       mesh: Mesh) -> dict:
    """Each field [B, ...] -> [k, B / k, ...]: microbatch j holds rows {j, j + k, j + 2k, ...}.

    A batch sharded over the data axes holds contiguous rows per device; splitting the rows
    as (B / k, k) keeps every device's rows on it (the sharded dimension is the major one),
    so microbatch j is the j-th of every device's own rows and no data moves: each
    microbatch stays sharded over the data axes like the full batch.
    """
    out = {}
    for name, x in batch.items():
        spec = tuple(batch_shardings[name].spec)
        lead, rest = (spec[0] if spec else None), spec[1:]
        y = jnp.swapaxes(x.reshape(x.shape[0] // k, k, *x.shape[1:]), 0, 1)
        out[name] = constrained(y, NamedSharding(mesh, PartitionSpec(None, lead, *rest)))
    return out


def float32_norm(tree) -> jax.Array:
    """The global L2 norm of a pytree, reduced in float32 whatever the leaves' dtype."""
    return optax.tree.norm(jax.tree.map(lambda g: g.astype(jnp.float32), tree))


def make_train_step(task: Task, layout: ModelLayout, state_layout: StateLayout,
                    tx: optax.GradientTransformation, batch_shardings: Mapping[str, NamedSharding],
                    mesh: Mesh, rules: RuleTable, donate: bool = True,
                    schedule: PipelineSchedule | None = None, *, grad_accum: int = 1,
                    ema_decay: float | None = None) -> Callable:
    """(state, batch) -> (state, metrics); one SPMD program for every device.

    Update `state.step` draws from `step_key(state.rng, state.step)`: the task's `rngs` and
    the model's own RNG streams; the model is in train mode.

    `grad_accum` k > 1: the global batch is split into k microbatches (`split_microbatches`)
    run one after another by a `lax.scan`; gradients are summed in float32 and divided by
    k, the loss and the task's aux metrics are the microbatches' means (for a mean-reduced
    loss: the full batch's loss), then one update. Microbatch j draws from
    `fold_in(step key, j)`. `ema_decay`: the state's EMA follows the new parameters.
    """
    task_loss = with_options(task.loss)
    param_shardings = state_layout.shardings.params
    name = type(task).__name__

    def train_step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        with framed("train_step", name):
            return _train_step(state, batch)

    def _train_step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        key = step_key(state.rng, state.step)
        with activation_sharding(mesh, rules), pipeline_schedule(schedule):
            def loss_fn(params, batch, key):
                model = layout.merge(params, key, train=True)
                with framed("train_step", name, model):
                    return task_loss(model, batch, key=key, train=True)

            grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
            if grad_accum == 1:
                (loss, aux), grads = grad_fn(state.params, batch, key)
            else:
                loss, aux, grads = _accumulate(grad_fn, state.params, batch, key)
            updates, opt_state = tx.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
        if ema_decay is not None and state.ema is not None:
            new_state = new_state.replace(ema=update_ema(state.ema, params, ema_decay))
        loss = jnp.asarray(loss, jnp.float32)
        grad_norm = float32_norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        metrics = {"loss": loss, "grad_norm": grad_norm,
                   "nonfinite": (~finite).astype(jnp.float32), **aux}
        if isinstance(opt_state, optax.ApplyIfFiniteState):  # train.nonfinite: skip
            metrics["skips"] = opt_state.total_notfinite.astype(jnp.float32)
            metrics["skips_in_a_row"] = opt_state.notfinite_count.astype(jnp.float32)
        return new_state, metrics

    def _accumulate(grad_fn, params, batch, key):
        f32 = jnp.float32

        def body(acc, xs):
            micro, j = xs
            (loss, aux), grads = grad_fn(params, micro, jax.random.fold_in(key, j))
            acc = constrained(jax.tree.map(lambda a, g: a + g.astype(f32), acc, grads),
                              param_shardings)
            return acc, (jnp.asarray(loss, f32), jax.tree.map(lambda v: jnp.asarray(v, f32), aux))

        zeros = constrained(jax.tree.map(lambda p: jnp.zeros(p.shape, f32), params),
                            param_shardings)
        micro = split_microbatches(batch, batch_shardings, grad_accum, mesh)
        acc, (losses, auxes) = jax.lax.scan(body, zeros, (micro, jnp.arange(grad_accum)))
        grads = jax.tree.map(lambda a, p: (a / grad_accum).astype(p.dtype), acc, params)
        return jnp.mean(losses), jax.tree.map(lambda v: jnp.mean(v, axis=0), auxes), grads

    return jax.jit(
        train_step,
        in_shardings=(state_layout.shardings, dict(batch_shardings)),
        out_shardings=(state_layout.shardings, replicated(mesh)),
        donate_argnums=(0,) if donate else (),
    )


def make_eval_step(task: Task, layout: ModelLayout, state_layout: StateLayout,
                   batch_shardings: Mapping[str, NamedSharding], mesh: Mesh,
                   rules: RuleTable, schedule: PipelineSchedule | None = None,
                   seed: int = 0) -> Callable:
    """(params, batch) -> metrics: the model in eval mode; a task that takes `rngs` gets
    streams from a fixed key (of `seed`, `train.seed`), so the metrics are deterministic."""
    metrics_of = with_options(task.eval_metrics)

    def eval_step(params: dict, batch: dict) -> dict:
        key = eval_key(train_rng(seed))
        with activation_sharding(mesh, rules), pipeline_schedule(schedule):
            model = layout.merge(params, key)
            with framed("eval_step", type(task).__name__, model):
                metrics = metrics_of(model, batch, key=key, train=False)
        return {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}

    return jax.jit(
        eval_step,
        in_shardings=(state_layout.shardings.params, dict(batch_shardings)),
        out_shardings=replicated(mesh),
    )


def make_sample_step(task: Task, layout: ModelLayout, state_layout: StateLayout,
                     batch_shardings: Mapping[str, NamedSharding], mesh: Mesh,
                     rules: RuleTable, schedule: PipelineSchedule | None = None) -> Callable:
    """Task.sample_outputs (the model in eval mode), jitted, gathered to every process (for
    plots of one prediction)."""

    def sample_step(params: dict, batch: dict) -> dict:
        with activation_sharding(mesh, rules), pipeline_schedule(schedule):
            model = layout.merge(params)
            with framed("sample", type(task).__name__, model):
                return task.sample_outputs(model, batch)

    return jax.jit(
        sample_step,
        in_shardings=(state_layout.shardings.params, dict(batch_shardings)),
        out_shardings=replicated(mesh),
    )
