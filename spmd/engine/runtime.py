"""Everything compiled for one config on one mesh: layouts, feed, jitted init/train/eval.

The engine reads its own sections only (`EngineSections`: mesh, train, optimizer,
schedule), never the whole run `Config`, and is handed a built task: resolving the task from
the config is the caller's (spmd.config.build_task). `check_rules` runs every check that
needs no model (rule table, pipeline, gradient accumulation, EMA evaluation) once; the
trainer runs it before anything is written in run.dir and hands its result to
`build_runtime`.

On a mesh of `AxisType.Explicit` axes (`mesh.axis_types: explicit`) the jitted init, train,
eval and sample steps are wrapped to run under `jax.set_mesh(mesh)` (spmd.engine.mesh.in_mesh).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import jax
import optax
from jax.sharding import Mesh

from spmd.data.loader.feed import BatchFeed
from spmd.engine.axis_rules import axis_rules, warn_replication
from spmd.engine.engine_config import EngineSections
from spmd.engine.executables import compile_or_load
from spmd.engine.mesh import in_mesh
from spmd.engine.model_errors import framed
from spmd.engine.pipeline_checks import check_grad_accum, check_pipeline
from spmd.engine.state import (
    ModelLayout,
    StateLayout,
    TrainState,
    ema_as_params,
    init_state_fn,
    make_optimizer,
    model_layout,
    state_layout,
)
from spmd.engine.step import make_eval_step, make_sample_step, make_train_step
from spmd.errors import ConfigError
from spmd.sharding import RuleTable
from spmd.sharding.pipeline import PipelineSchedule
from spmd.tasks import Task


@dataclass(frozen=True)
class CheckedRules:
    """What `check_rules` resolved: the rule table, and the pipeline schedule when the rules
    split layers into stages."""

    rules: RuleTable
    schedule: PipelineSchedule | None


def check_rules(sections: EngineSections, task: Task, mesh: Mesh) -> CheckedRules:
    """Every check of the engine's sections against the task and the mesh that needs no
    model, raising the error that names the config key: the rule table (`mesh.rules`, the
    task's own rules, `mesh.axis_aliases`), the pipeline and gradient-accumulation settings,
    and `train.eval_ema` without an EMA."""
    train = sections.train
    rules = axis_rules(sections.mesh, task)
    schedule = check_pipeline(train, sections.mesh, task, rules, mesh)
    check_grad_accum(train, rules, mesh)
    if train.eval_ema and train.ema_decay is None:
        raise ConfigError("train.eval_ema=true evaluates with the EMA of the parameters, but "
                          "train.ema_decay is null (no EMA is kept): set train.ema_decay "
                          "(e.g. 0.999) or train.eval_ema=false")
    return CheckedRules(rules, schedule)


@dataclass
class Runtime:
    sections: EngineSections   # the config sections it was built from (not the whole Config)
    task: Task
    mesh: Mesh
    rules: RuleTable
    tx: optax.GradientTransformation
    model: ModelLayout
    state: StateLayout
    feed: BatchFeed
    init: Callable
    train_step: Callable
    eval_step: Callable | None
    sample_step: Callable | None
    pipeline: PipelineSchedule | None = None   # bound when the rules split layers into stages
    # The eval batches' feed: `feed` itself unless the task's `eval_batch_fields()` differ
    # (e.g. a rollout target of many steps); eval_step and sample_step are compiled for it.
    eval_feed: BatchFeed | None = None

    def __post_init__(self) -> None:
        if self.eval_feed is None:
            self.eval_feed = self.feed

    def abstract_batch(self) -> dict[str, jax.ShapeDtypeStruct]:
        """ShapeDtypeStructs of one global batch, carrying the feed's shardings."""
        return {name: jax.ShapeDtypeStruct(f.global_shape(self.sections.train.batch_size), f.dtype,
                                           sharding=self.feed.shardings[name])
                for name, f in self.feed.fields.items()}

    def compile_train_step(self) -> tuple[Callable, float]:
        """Lower and compile the train step on abstract inputs: (executable, seconds).

        Ahead of time, so a first step's time is a step's, and `spmd plan` reads the same
        executable that training runs.
        """
        compiled, seconds, _ = self.load_or_compile_train_step(None, 0)
        return compiled, seconds

    def load_or_compile_train_step(self, store: Path | None, rank: int,
                                   shared: Path | None = None) -> tuple[Callable, float, str]:
        """`compile_train_step`, but with a `store` (run.keep_executables) this rank's
        executable is loaded from it, or from `shared` (spmd.engine.executables.shared_store),
        when it holds one of this very program and devices, and kept there otherwise
        (spmd.engine.executables): (executable, seconds, "loaded" or "compiled")."""
        start = time.perf_counter()
        lowered = self.train_step.lower(self.state.abstract, self.abstract_batch())
        with framed("compile", type(self.task).__name__):   # an exception from XLA: framed
            compiled, how = compile_or_load(lowered, store, rank, shared=shared)
        return compiled, time.perf_counter() - start, how

    def eval_params(self, state: TrainState) -> dict:
        """The parameters evaluation uses: the EMA's (cast to the parameters' dtypes) with
        `train.eval_ema`, else the state's own."""
        if self.sections.train.eval_ema and state.ema is not None:
            return ema_as_params(state.ema, self.state.abstract.params)
        return state.params


def build_runtime(sections: EngineSections, mesh: Mesh, task: Task,
                  checked: CheckedRules | None = None) -> Runtime:
    """Resolve every sharding (failing early with precise errors) and build the jitted steps.

    `checked`: `check_rules(sections, task, mesh)`'s result when the caller ran the checks
    already (the trainer, before run.dir is touched); without it they run here.
    """
    train = sections.train
    checked = checked or check_rules(sections, task, mesh)
    rules, schedule = checked.rules, checked.schedule
    model = model_layout(task, train.seed, rules, mesh)
    tx = make_optimizer(sections, task, model)   # the weight-decay mask reads the layout
    model.report.check_replicated_fraction(sections.mesh.max_replicated_fraction)
    warn_replication(model.report, sections.mesh)   # nothing replicated silently: log it
    state = state_layout(model, tx, rules, mesh, ema=train.ema_decay is not None)
    feed = BatchFeed(task.batch_fields(), train.batch_size, mesh, rules)
    train_step = make_train_step(task, model, state, tx, feed.shardings, mesh, rules,
                                 donate=train.donate, schedule=schedule,
                                 grad_accum=train.grad_accum, ema_decay=train.ema_decay)
    eval_fields = task.eval_batch_fields()
    eval_feed = (BatchFeed(eval_fields, train.batch_size, mesh, rules)
                 if eval_fields is not None else feed)
    eval_step = (make_eval_step(task, model, state, eval_feed.shardings, mesh, rules, schedule,
                                seed=train.seed)
                 if task.eval_source() is not None else None)
    has_samples = type(task).sample_outputs is not Task.sample_outputs
    sample_step = (make_sample_step(task, model, state, eval_feed.shardings, mesh, rules,
                                    schedule)
                   if eval_step is not None and has_samples else None)
    init = init_state_fn(task, train.seed, tx, state)
    # mesh.axis_types=explicit: traced (first call, lower) under jax.set_mesh(mesh)
    return Runtime(sections, task, mesh, rules, tx, model, state, feed,
                   in_mesh(init, mesh), in_mesh(train_step, mesh), in_mesh(eval_step, mesh),
                   in_mesh(sample_step, mesh), schedule, eval_feed)
