"""The sections the engine builds from: `mesh:` (the device mesh and the rule table) and
`train:` (the step: batch, seed, pipeline, accumulation, EMA), and `EngineSections`, the
explicit bundle of the four sections the engine reads (with `optimizer:` and `schedule:`
from spmd.optim).

They live here, next to the mesh, state and step code; this module imports nothing of spmd
but spmd.optim's sections (pydantic only, no JAX), so a login node can validate a config.
`spmd.config` assembles them into the run's `Config`; the engine is handed
`cfg.engine_sections()`, never the whole `Config`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from spmd.optim.optimizers import OptimizerConfig
from spmd.optim.schedules import ScheduleConfig


class MeshConfig(BaseModel):
    """mesh: the device mesh and the rule table that puts logical axes on its axes."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    strategy: Literal["dp", "fsdp", "tp", "fsdp_tp", "sp", "pp", "pp_fsdp", "spatial"] = Field(
        "dp", description="The preset rule table and mesh shape (docs/sharding.md).")
    axes: dict[str, int] = Field(
        default_factory=dict, description="Sizes per mesh axis (data, stage, fsdp, context, "
        "tensor, expert); one -1 absorbs the rest. Missing axes take the preset's value or 1.")
    rules: dict[str, str | list[str] | None] = Field(
        default_factory=dict, description="Single-entry overrides of the preset's rule table: "
        "logical axis -> mesh axis | [axes] | null (replicated); `activation_<logical>` for "
        "activations only.")
    axis_aliases: dict[str, str | list[str] | None] = Field(
        default_factory=dict, description="Mesh axis names used by a task's own (Flax-style) "
        "logical-axis rules -> spmd's mesh axes, e.g. {model: tensor}; null replicates what "
        "the task put on that axis.")
    axis_types: Literal["auto", "explicit"] = Field(
        "auto", description="JAX's axis types for the mesh. auto: the compiler propagates "
        "shardings (spmd's models, with_axes / nnx.with_partitioning names). explicit: "
        "AxisType.Explicit, for models written for JAX's explicit sharding (Flax's Gemma: "
        "PartitionSpecs of mesh-axis names, out_sharding=P(...), jax.sharding.reshard); the "
        "model's construction, the steps, evaluation and prediction run under jax.set_mesh "
        "(docs/sharding.md, 'Explicit sharding').")
    fsdp_min_bytes: int | None = Field(
        2**20, ge=0, description="FSDP for any model: under a strategy with an fsdp axis, a "
        "parameter of at least this many bytes that no rule puts on fsdp is split along its "
        "largest dimension the fsdp ways divide; smaller ones stay replicated. null: only the "
        "rules shard over fsdp.")
    require_annotations: bool = Field(
        False, description="Refuse a parameter that the model gave no logical axes (neither "
        "with_axes nor nnx.with_partitioning), naming its path. false: such a parameter gets "
        "one unnamed (None) axis per dimension, replicated, or placed by auto-FSDP "
        "(mesh.fsdp_min_bytes) under an fsdp axis.")
    warn_replicated_bytes: int | None = Field(
        2**20, ge=0, description="A parameter of at least this many bytes left whole on every "
        "device while a mesh axis that splits parameters is > 1 is named in a warning (with "
        "the rule to change). null: no such warning.")
    max_replicated_fraction: float | None = Field(
        None, ge=0.0, le=1.0, description="Fail when parameter storage is more redundant than "
        "this (0: fully sharded, 1: fully replicated). null: no bound.")


class TrainConfig(BaseModel):
    """train: the updates, the global batch and what one jitted step does."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    steps: int = Field(10, ge=0, description="Updates to train.")
    batch_size: int = Field(
        8, ge=1, description="The global batch: examples per update over all ranks.")
    seed: int = Field(0, description="Seed of initialization, dropout and the data order.")
    eval_every: int = Field(0, ge=0, description="Updates between evaluations (0: never).")
    donate: bool = Field(
        True, description="Donate the state's buffers to the step (updated in place).")
    nonfinite: Literal["stop", "skip"] = Field(
        "stop", description="A non-finite loss or gradient norm: `stop` ends the run (status "
        "65) without saving the non-finite state; `skip` leaves parameters and optimizer state "
        "unchanged for that step and stops after `max_skips` skipped steps in a row.")
    max_skips: int = Field(
        10, ge=1, description="With nonfinite: skip, the skipped steps in a row that stop the "
        "run.")
    microbatches: int = Field(
        1, ge=1, description="Pipelined strategies (layers on stage): microbatches per step; "
        "train.batch_size must divide by microbatches x the data-parallel ways.")
    pipeline_schedule: Literal["gpipe", "1f1b"] = Field(
        "gpipe", description="Pipelined strategies: gpipe (all forward, then all backward) or "
        "1f1b (one forward, one backward).")
    pipeline_repeats: int = Field(
        1, ge=1, description="Pipelined strategies: > 1 is a circular gpipe (stage k runs "
        "layer chunks k, k + S, ...).")
    grad_accum: int = Field(
        1, ge=1, description="Gradient accumulation: each global batch is split into this many "
        "sequential microbatches inside the jitted step (gradients summed in float32), one "
        "update. train.batch_size must divide by grad_accum x the data-parallel ways.")
    ema_decay: float | None = Field(
        None, gt=0, lt=1, description="Keep an exponential moving average of the parameters "
        "in the train state (sharded like them, checkpointed). null: no EMA.")
    eval_ema: bool = Field(
        False, description="Evaluate with the EMA of the parameters (needs train.ema_decay).")


@dataclass(frozen=True)
class EngineSections:
    """The config sections the engine reads, and nothing else of the run's `Config`
    (`Config.engine_sections()` builds it)."""

    mesh: MeshConfig
    train: TrainConfig
    optimizer: OptimizerConfig
    schedule: ScheduleConfig
