"""The jitted train and eval steps: explicit in/out shardings, donated state.

Training runs the model in train mode (`model.train()`: Dropout active), evaluation and
samples in eval mode (`model.eval()`), each step's randomness drawn from the state's key and
the step (spmd.engine.state: `step_key`). A task's `loss` and `eval_metrics` may take
keyword arguments `rngs` (an `nnx.Rngs` with `dropout` and `default` streams) and `train`;
`task_options` finds out once which ones, and only those are passed.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding

from spmd.engine.state import (
    ModelLayout,
    StateLayout,
    TrainState,
    eval_key,
    replicated,
    step_key,
    task_rngs,
    train_rng,
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


def make_train_step(task: Task, layout: ModelLayout, state_layout: StateLayout,
                    tx: optax.GradientTransformation, batch_shardings: Mapping[str, NamedSharding],
                    mesh: Mesh, rules: RuleTable, donate: bool = True,
                    schedule: PipelineSchedule | None = None) -> Callable:
    """(state, batch) -> (state, metrics); one SPMD program for every device.

    Update `state.step` draws from `step_key(state.rng, state.step)`: the task's `rngs` and
    the model's own RNG streams; the model is in train mode."""
    task_loss = with_options(task.loss)

    def train_step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        key = step_key(state.rng, state.step)
        with activation_sharding(mesh, rules), pipeline_schedule(schedule):
            def loss_fn(params):
                model = layout.merge(params, key, train=True)
                return task_loss(model, batch, key=key, train=True)

            (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
            updates, opt_state = tx.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        metrics = {"loss": loss, "grad_norm": grad_norm,
                   "nonfinite": (~finite).astype(jnp.float32), **aux}
        if isinstance(opt_state, optax.ApplyIfFiniteState):  # train.nonfinite: skip
            metrics["skips"] = opt_state.total_notfinite.astype(jnp.float32)
            metrics["skips_in_a_row"] = opt_state.notfinite_count.astype(jnp.float32)
        return new_state, metrics

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
            metrics = metrics_of(layout.merge(params, key), batch, key=key, train=False)
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
            return task.sample_outputs(layout.merge(params), batch)

    return jax.jit(
        sample_step,
        in_shardings=(state_layout.shardings.params, dict(batch_shardings)),
        out_shardings=replicated(mesh),
    )
