"""The jitted train and eval steps: explicit in/out shardings, donated state."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding

from spmd.engine.state import ModelLayout, StateLayout, TrainState, replicated
from spmd.sharding import RuleTable, activation_sharding
from spmd.sharding.pipeline import PipelineSchedule, pipeline_schedule
from spmd.tasks.base import Task


def make_train_step(task: Task, layout: ModelLayout, state_layout: StateLayout,
                    tx: optax.GradientTransformation, batch_shardings: Mapping[str, NamedSharding],
                    mesh: Mesh, rules: RuleTable, donate: bool = True,
                    schedule: PipelineSchedule | None = None) -> Callable:
    """(state, batch) -> (state, metrics); one SPMD program for every device."""

    def train_step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        with activation_sharding(mesh, rules), pipeline_schedule(schedule):
            def loss_fn(params):
                return task.loss(layout.merge(params), batch)

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
                   rules: RuleTable, schedule: PipelineSchedule | None = None) -> Callable:
    def eval_step(params: dict, batch: dict) -> dict:
        with activation_sharding(mesh, rules), pipeline_schedule(schedule):
            metrics = task.eval_metrics(layout.merge(params), batch)
        return {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}

    return jax.jit(
        eval_step,
        in_shardings=(state_layout.shardings.params, dict(batch_shardings)),
        out_shardings=replicated(mesh),
    )


def make_sample_step(task: Task, layout: ModelLayout, state_layout: StateLayout,
                     batch_shardings: Mapping[str, NamedSharding], mesh: Mesh,
                     rules: RuleTable, schedule: PipelineSchedule | None = None) -> Callable:
    """Task.sample_outputs, jitted, gathered to every process (for plots of one prediction)."""

    def sample_step(params: dict, batch: dict) -> dict:
        with activation_sharding(mesh, rules), pipeline_schedule(schedule):
            return task.sample_outputs(layout.merge(params), batch)

    return jax.jit(
        sample_step,
        in_shardings=(state_layout.shardings.params, dict(batch_shardings)),
        out_shardings=replicated(mesh),
    )
