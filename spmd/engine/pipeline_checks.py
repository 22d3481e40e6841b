"""Config checks for pipelined strategies, in the words of the config keys to change.

A pipeline is on when the rule table shards `layers` over mesh axes of total size S > 1
(presets `pp`, `pp_fsdp`). `check_pipeline` runs before anything is compiled and either
returns the `PipelineSchedule` the steps bind, or raises a one-line ConfigError:
- the model has no parameters with a `layers` axis (unstacked blocks, or a model with no
  layer stack such as the mlp or fno tasks);
- the stacked layer count is not divisible by S x R (`model.num_layers`, `mesh.axes.stage`,
  `train.pipeline_repeats`);
- `train.batch_size` is not divisible by `train.microbatches` x the data-parallel ways;
- `train.pipeline_repeats` > 1 with `1f1b`, or with `train.microbatches` not a multiple of S
  (the circular schedule sends microbatches round in groups of S);
- `train.microbatches` or `train.pipeline_repeats` > 1 without a pipeline (it would silently
  do nothing);
- `train.grad_accum` > 1 with a pipeline (the pipeline's microbatches already split the
  batch: raise `train.microbatches` instead).

`check_grad_accum` checks gradient accumulation on any strategy: `train.batch_size` must be
divisible by `train.grad_accum` x the data-parallel ways (every microbatch splits evenly).
"""

from __future__ import annotations

import math

from flax import nnx
from jax.sharding import Mesh

from spmd.data.loader.feed import nearest_multiples
from spmd.engine.engine_config import MeshConfig, TrainConfig
from spmd.errors import ConfigError
from spmd.sharding import (
    ACTIVATION_PREFIX,
    RuleTable,
    ShardingReport,
    annotated_axes,
    path_str,
)
from spmd.sharding.pipeline import (
    LAYERS,
    PipelineSchedule,
    bubble_fraction,
    stage_axes,
)
from spmd.tasks.base import Task


def _stacked_layers(task: Task, seed: int) -> int | None:
    """Size of the `layers` dimension of the model's stacked parameters (None: no stack)."""
    with nnx.use_eager_sharding(False):   # Flax-annotated models: no mesh needed
        abstract = nnx.eval_shape(lambda: task.build_model(nnx.Rngs(seed)))
    for path, variable in nnx.to_flat_state(nnx.state(abstract, nnx.Param)):
        shape = tuple(getattr(variable.get_value(), "shape", ()))
        annotation = annotated_axes(variable.get_metadata(), shape, path_str(path))
        axes = annotation.axes if annotation is not None else ()
        if LAYERS in axes:
            return variable.get_value().shape[list(axes).index(LAYERS)]
    return None


def _data_ways(rules: RuleTable, shape: dict[str, int]) -> tuple[int, str]:
    axes = rules.lookup(ACTIVATION_PREFIX + "batch") or rules.lookup("batch") or ()
    active = [a for a in axes if shape[a] > 1]
    return math.prod(shape[a] for a in active), " x ".join(f"{a}={shape[a]}" for a in active)


def check_pipeline(train: TrainConfig, mesh_cfg: MeshConfig, task: Task, rules: RuleTable,
                   mesh: Mesh) -> PipelineSchedule | None:
    """The schedule to bind when `layers` is split into stages, else None; ConfigError if bad.

    Reads the `train:` section (microbatches, schedule, repeats, batch size, seed) and the
    `mesh:` section (its strategy, named in errors); the model's own keys come from
    `task.model_cfg`.
    """
    t, shape = train, dict(mesh.shape)
    axes = stage_axes(rules, shape)
    if not axes:
        for key, value in (("microbatches", t.microbatches),
                           ("pipeline_repeats", t.pipeline_repeats)):
            if value > 1:
                raise ConfigError(
                    f"train.{key}={value} needs pipeline stages, but "
                    f"mesh.strategy={mesh_cfg.strategy} does not split 'layers' over a mesh "
                    f"axis larger than 1; use mesh.strategy=pp (mesh.axes.stage > 1) or "
                    f"train.{key}=1")
        return None
    stages = math.prod(shape[a] for a in axes)
    where = ", ".join(f"mesh.axes.{a}={shape[a]}" for a in axes)
    if t.grad_accum > 1:
        raise ConfigError(
            f"train.grad_accum={t.grad_accum} does not compose with the pipeline of "
            f"mesh.strategy={mesh_cfg.strategy} ({stages} stages, {where}), which already "
            f"splits each batch into train.microbatches={t.microbatches}: set "
            f"train.grad_accum=1 and raise train.microbatches instead")
    layers = _stacked_layers(task, t.seed)
    model_fields = type(task.model_cfg).model_fields
    if layers is None:
        hint = ("set model.scan_layers=true" if "scan_layers" in model_fields
                else "this task's model has no stack of identical layers")
        raise ConfigError(
            f"mesh.strategy={mesh_cfg.strategy} splits stacked layers into {stages} pipeline "
            f"stages ({where}), but the model has no parameters with a 'layers' axis; {hint}, "
            f"or use a strategy without stages (e.g. mesh.strategy=dp)")
    repeats = t.pipeline_repeats
    if layers % (stages * repeats):
        key = ("model.num_layers" if "num_layers" in model_fields
               else "the stacked layer count")
        times = f" x train.pipeline_repeats={repeats}" if repeats > 1 else ""
        raise ConfigError(
            f"{key}={layers} is not divisible by the {stages} pipeline stages ({where})"
            f"{times}; change {key} or mesh.axes.stage"
            f"{' or train.pipeline_repeats' if repeats > 1 else ''}")
    if repeats > 1 and t.pipeline_schedule != "gpipe":
        raise ConfigError(
            f"train.pipeline_repeats={repeats} (circular pipeline) runs with "
            f"train.pipeline_schedule=gpipe only, not {t.pipeline_schedule}; set one of them "
            f"back")
    if repeats > 1 and t.microbatches % stages:
        raise ConfigError(
            f"train.pipeline_repeats={repeats} sends microbatches round the {stages} stages "
            f"({where}) in groups of {stages}: make train.microbatches={t.microbatches} a "
            f"multiple of {stages}")
    ways, data_axes = _data_ways(rules, shape)
    if t.batch_size % (t.microbatches * ways):
        raise ConfigError(
            f"train.batch_size={t.batch_size} is not divisible by train.microbatches="
            f"{t.microbatches} x {ways} data-parallel ways ({data_axes or 'none'}); use a "
            f"multiple of {t.microbatches * ways}: "
            f"{' or '.join(map(str, nearest_multiples(t.batch_size, t.microbatches * ways)))}, "
            f"or change train.microbatches")
    return PipelineSchedule(t.microbatches, t.pipeline_schedule, repeats)


def check_grad_accum(train: TrainConfig, rules: RuleTable, mesh: Mesh) -> None:
    """ConfigError unless `train.batch_size` divides by `train.grad_accum` x the data ways."""
    k = train.grad_accum
    if k == 1:
        return
    ways, data_axes = _data_ways(rules, dict(mesh.shape))
    if train.batch_size % (k * ways):
        raise ConfigError(
            f"train.batch_size={train.batch_size} is not divisible by train.grad_accum={k} x "
            f"{ways} data-parallel ways ({data_axes or 'none'}): each of the {k} microbatches "
            f"must split evenly over the data axes; use a multiple of {k * ways}: "
            f"{' or '.join(map(str, nearest_multiples(train.batch_size, k * ways)))}, or "
            f"change train.grad_accum")


def stage_summary(report: ShardingReport, rules: RuleTable, mesh: Mesh,
                  schedule: PipelineSchedule | None) -> dict | None:
    """Per-stage figures for `spmd shardings` and `spmd plan` (None without a pipeline).

    `bubble_fraction` is (S - 1) / (R M + S - 1), the idle fraction of both schedules.
    `stacked_bytes_per_device` is what one device holds of the parameters with a `layers`
    axis; `stacked_bytes_unstaged_per_device` the same with the stage axes dropped from
    their specs (what the strategy without stages would hold): about `stages` times more.
    """
    shape = dict(mesh.shape)
    axes = stage_axes(rules, shape)
    if not axes or schedule is None:
        return None
    stages = math.prod(shape[a] for a in axes)
    stacked = [p for p in report.params if LAYERS in p.logical_axes]
    unstaged_shape = {a: (1 if a in axes else s) for a, s in shape.items()}
    layers = stacked[0].shape[list(stacked[0].logical_axes).index(LAYERS)] if stacked else 0
    return {
        "stages": stages,
        "stage_axes": list(axes),
        "microbatches": schedule.microbatches,
        "schedule": schedule.schedule,
        "repeats": schedule.repeats,
        "bubble_fraction": bubble_fraction(stages, schedule.microbatches, schedule.repeats),
        "layers_per_stage": layers // stages,      # in R chunks of layers / (S R)
        "stacked_bytes_per_device": sum(p.bytes_per_device(shape) for p in stacked),
        "stacked_bytes_unstaged_per_device": sum(p.bytes_per_device(unstaged_shape)
                                                 for p in stacked),
    }
