"""The run configuration's schema: one frozen pydantic section per component, and `Config`.

Nearly a leaf: it imports nothing of spmd but `spmd.errors` and the sections that live next
to the code that builds from them (`spmd.optim`: optimizer, schedule), so every layer may
type against it.
Each component takes its own section (`CheckpointConfig`, `TrainConfig`, ...), never the
whole `Config`. Reading YAML, overrides and resolving the task live in `spmd.config.load`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, SerializeAsAny, model_validator

from spmd.optim.optimizers import OptimizerConfig
from spmd.optim.schedules import ScheduleConfig

log = logging.getLogger("spmd.config")

# Keys of `train:` that moved (spmd 0.x): old key -> (section, key). Still read, for one
# release, with a warning naming the new key.
DEPRECATED_KEYS: dict[str, tuple[str, str]] = {
    "lr": ("optimizer", "lr"),
    "warmup_steps": ("schedule", "warmup_steps"),
    "weight_decay": ("optimizer", "weight_decay"),
    "grad_clip": ("optimizer", "grad_clip"),
}
_warned: set[str] = set()


def migrate_deprecated(raw: Any, warn: bool = True) -> Any:
    """A raw config (dict) with the deprecated `train.*` keys moved to their new sections,
    each warned about once per process (`warn`); both the old and the new key set is an
    error."""
    if not isinstance(raw, dict) or not isinstance(raw.get("train"), dict):
        return raw
    train = dict(raw["train"])
    moved = [k for k in DEPRECATED_KEYS if k in train]
    if not moved:
        return raw
    raw = dict(raw)
    for old in moved:
        section, key = DEPRECATED_KEYS[old]
        value = train.pop(old)
        target = raw.get(section)
        if target is None:
            target = {}
        elif isinstance(target, BaseModel):
            target = target.model_dump(exclude_unset=True)
        if not isinstance(target, dict):
            continue   # the section's own validation names the problem
        if key in target:
            raise ValueError(f"train.{old} is deprecated and {section}.{key} is set too: "
                             f"remove train.{old}")
        raw[section] = {**target, key: value}
        if warn and old not in _warned:
            _warned.add(old)
            log.warning("config key train.%s is deprecated (read for one more release): use "
                        "%s.%s", old, section, key)
    raw["train"] = train
    return raw


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ProfileConfig(_Section):
    """run.profile: a JAX profiler trace of updates steps[0]..steps[1] (inclusive) on the
    ranks listed, in run.dir/profile/ (docs/observability.md). Off (no hook) without steps."""

    steps: tuple[int, int] | None = None
    ranks: list[int] = Field(default_factory=lambda: [0])

    @model_validator(mode="after")
    def _ordered(self) -> ProfileConfig:
        if self.steps is not None and not 1 <= self.steps[0] <= self.steps[1]:
            raise ValueError(f"run.profile.steps must be [start, stop] with 1 <= start <= stop "
                             f"(updates done, as in metrics.jsonl); got {list(self.steps)}")
        return self


class RunConfig(_Section):
    dir: Path = Path("runs/default")
    log_every: int = Field(1, ge=1)
    progress: bool = True
    log_level: Literal["info", "debug"] = Field(
        "info", description="info: the console shows rank 0's phases, progress and messages, "
        "and every rank's warnings and errors, while the internal `key=value` records go to "
        "the rank logs (run.dir/logs) and events.jsonl only; debug: the console shows those "
        "records too, and the rank logs get DEBUG records (`-v` on `spmd train` and `spmd "
        "run` sets it).")
    plots: bool = True        # rank 0 writes run.dir/plots/*.png when training ends
    # A run.dir lease held from another host without a heartbeat this long is taken over.
    lease_stale_s: float = Field(300.0, gt=0)
    # JAX's persistent compilation cache: a requeued or resumed job loads its compiled
    # steps from here instead of compiling again (null: off, or JAX_COMPILATION_CACHE_DIR).
    compilation_cache: Path | None = None
    profile: ProfileConfig = ProfileConfig()
    # Where rank 0 also sends every metrics.jsonl scalar and the resolved config (the
    # optional ones need their pip extra: spmd-hpc[wandb], spmd-hpc[mlflow]).
    trackers: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(default_factory=list)


class ModelConfig(BaseModel):
    """Base of a task's `model:` section (its class attribute `Task.Config`): strict, frozen.

    `name` is optional for a task named by `task: module:Class`; a registered task's name
    (e.g. `fno`) selects it when `task:` is absent.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str | None = None


class MeshConfig(_Section):
    strategy: Literal["dp", "fsdp", "tp", "fsdp_tp", "sp", "pp", "pp_fsdp", "spatial"] = "dp"
    # Sizes per mesh axis; one -1 absorbs the rest. Missing axes take the preset's value or 1.
    axes: dict[str, int] = Field(default_factory=dict)
    # Single-entry overrides of the preset's rule table: logical -> axis | [axes] | null.
    rules: dict[str, str | list[str] | None] = Field(default_factory=dict)
    # Mesh axis names used by a task's own (Flax-style) logical-axis rules -> spmd's mesh
    # axes, e.g. {model: tensor}; null replicates what the task put on that axis.
    axis_aliases: dict[str, str | list[str] | None] = Field(default_factory=dict)
    # FSDP for any model: under a strategy with an fsdp axis, a parameter of at least this many
    # bytes that no rule puts on fsdp is split along its largest dimension the fsdp ways
    # divide; smaller ones stay replicated. null: only the rules shard over fsdp.
    fsdp_min_bytes: int | None = Field(2**20, ge=0)
    # A parameter of at least this many bytes left whole on every device while a mesh axis
    # that splits parameters is > 1 is named in a warning (with the rule to change). null: no
    # such warning (a strategy whose own axis shards no parameter is still warned about).
    warn_replicated_bytes: int | None = Field(2**20, ge=0)
    max_replicated_fraction: float | None = Field(None, ge=0.0, le=1.0)


class TrainConfig(_Section):
    steps: int = Field(10, ge=0)
    batch_size: int = Field(8, ge=1)
    seed: int = 0
    eval_every: int = Field(0, ge=0)
    donate: bool = True
    # A non-finite loss or gradient norm: `stop` ends the run (status 65) without saving the
    # non-finite state; `skip` leaves parameters and optimizer state unchanged for that step
    # and stops after `max_skips` skipped steps in a row.
    nonfinite: Literal["stop", "skip"] = "stop"
    max_skips: int = Field(10, ge=1)
    # Pipelined strategies (layers on stage): microbatches per step and their schedule;
    # repeats > 1 is a circular gpipe (stage k runs layer chunks k, k + S, ...).
    microbatches: int = Field(1, ge=1)
    pipeline_schedule: Literal["gpipe", "1f1b"] = "gpipe"
    pipeline_repeats: int = Field(1, ge=1)
    # Gradient accumulation: each global batch is split into this many sequential
    # microbatches inside the jitted step (gradients summed in float32), one update.
    grad_accum: int = Field(1, ge=1)
    # An exponential moving average of the parameters kept in the train state (sharded like
    # them, checkpointed); eval_ema: evaluate with it. null: no EMA.
    ema_decay: float | None = Field(None, gt=0, lt=1)
    eval_ema: bool = False


class WindowConfig(_Section):
    # Examples are time windows of stored trajectories (a dataset `[trajectory, time, ...]`,
    # or `[time, ...]`: one trajectory per file): `input_steps` frames in, the next
    # `target_steps` frames as the target, a window starting every `stride` time steps.
    # A window never crosses from one trajectory into the next (spmd.data.windows).
    input_steps: int = Field(1, ge=1)
    target_steps: int = Field(1, ge=1)
    stride: int = Field(1, ge=1)


class DataConfig(_Section):
    # Array files: hdf5 | netcdf (NetCDF4) | zarr | npy (the reader detects each file's format).
    source: Literal["synthetic", "hdf5", "netcdf", "zarr", "npy"] = "synthetic"
    # A store (file, Zarr store, directory of .npy), a directory of stores or a glob of them,
    # concatenated along the first axis in sorted path order (docs/data.md). Made by `spmd
    # data make` if missing (one file).
    path: Path | None = None
    # batch field -> dataset path in data.path ("{split}" stands for train / test); fields
    # not named here take the task's default path (spmd.data.ArraySource)
    fields: dict[str, str] = Field(default_factory=dict)
    num_train: int = Field(1000, ge=1)
    num_test: int = Field(100, ge=1)
    eval_batches: int = Field(2, ge=1)
    seed: int = Field(0, ge=0)        # generator seed of a dataset made by `spmd data make`
    solver: dict[str, Any] = Field(default_factory=dict)
    # Background reads: the batches of the next `prefetch` steps are read by `read_threads`
    # threads while a step runs (0: read when the step needs it). Batches are identical.
    # One thread is fastest for HDF5 (h5py serializes calls) and Zarr (a call's chunks are
    # read concurrently); more help .npy memory maps on a slow file system.
    prefetch: int = Field(2, ge=0)
    read_threads: int = Field(1, ge=1)
    # The train split's order (docs/data.md): the split is cut into blocks of
    # `shuffle_block` consecutive records, visited in a shuffled order `shuffle_mix` blocks
    # at a time, the records of those blocks shuffled together: each batch draws from
    # `shuffle_mix` places of the split, and the readahead reads each block whole (long
    # reads on a cold cache or a parallel file system). auto: blocks of about 4 MiB of
    # records (records of 4 MiB or more: full); full (or null): no blocks, a full shuffle of
    # the split every epoch (grain's). Changing either changes the order, as the seed does;
    # a resumed run keeps its own order unless they are set (spmd.loop.recipe).
    shuffle_block: Annotated[int, Field(ge=1)] | Literal["auto", "full"] | None = "auto"
    shuffle_mix: int = Field(16, ge=1)
    # Trajectory windows instead of stored (input, target) pairs; None: stored examples.
    window: WindowConfig | None = None
    # Train on fields normalized per channel with the statistics `spmd data stats CONFIG`
    # stored beside the data ((x - mean) / std); metrics and predictions stay in physical
    # units. Tasks that support it: FieldTask and its subclasses (spmd.data.normalization).
    normalize: bool = False


class CheckpointConfig(_Section):
    every: int = Field(0, ge=0)            # steps between node-local saves (0 = never)
    persistent_every: int = Field(0, ge=0)  # steps between persistent-tier saves (0 = never)
    # The last step of a run that ends (finished, or stopped by a hook) is committed to the
    # persistent tier whatever `every` and `persistent_every` say, so that every finished
    # run is loadable (spmd.load, spmd eval/predict/export). false: no such final save.
    final: bool = True
    local_dir: Path | None = None           # node-local tier; None = <run.dir>/local
    persistent_dir: Path | None = None      # None = <run.dir>/checkpoints
    keep: int = Field(2, ge=1)
    partner: bool | None = None             # None = on when there is more than one node
    async_: bool = Field(True, alias="async")
    timeout_s: float = Field(600.0, gt=0)
    compress: bool = False                  # zstd in the persistent tier (Orbax's default: on)
    # What a save blocks for: auto | alias (CPU: zero-copy views, as Orbax) | host (D2H into
    # reused host buffers) | pinned (D2H into pinned host memory) | device (on-device copy,
    # D2H in the background). See spmd/checkpoint/snapshot.py.
    snapshot: Literal["auto", "alias", "host", "pinned", "device"] = "auto"
    # A local-tier save that fails (full or broken node-local disk): `continue` logs it and
    # trains on, saving to the persistent tier; `stop` ends the run as any failed save does.
    local_failure: Literal["continue", "stop"] = "continue"
    # Resuming with a different optimizer.name than the run's previous job (its config.yaml):
    # restore the parameters only, with a fresh optimizer state, and go on from the
    # checkpoint's step (schedule and data position continue). Without it such a resume is
    # an error. With the same optimizer.name, the whole state is restored as always.
    params_only: bool = False

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class LaunchConfig(_Section):
    init_timeout_s: float = Field(300.0, gt=0)
    heartbeat_timeout_s: float = Field(100.0, gt=0)
    barrier_timeout_s: float = Field(300.0, gt=0)
    # Stop (and save) this many seconds before the allocation's known end time.
    walltime_margin_s: float = Field(300.0, ge=0)
    # The hang watchdog: a rank whose training step has not completed for this long dumps
    # every thread's stack, names the ranks that did not reach the step, and the job exits
    # with ExitCode.HUNG. None: automatic, max(600, 20 x the median step time after warm-up);
    # 0: off. Compilation, restore and checkpoint saves have their own bounds.
    step_timeout_s: float | None = Field(None, ge=0)
    # A rank whose host-side step time exceeds this factor x the median over ranks for 3
    # checks in a row (one check every run.log_every steps) is named as a straggler.
    straggler_factor: float = Field(1.3, gt=1)
    # `spmd run` on SIGTERM/SIGINT: ranks that have not ended checkpoint.timeout_s + this
    # many seconds after it (a stuck rank never reaches its save) are killed (Slurm's KillWait).
    kill_wait_s: float = Field(30.0, ge=0)
    prepare_timeout_s: float = Field(
        7200.0, gt=0, description="Seconds the other ranks wait for rank 0's one-time data "
        "preparation before training (Task.prepare: making a missing data set, an index, "
        "statistics), logging what they wait for every 30 s. The wait is over the key-value "
        "store, before any collective, so it has no other deadline; past this, the job fails "
        "naming the rank. Make the data beforehand (`spmd data make`) to skip the wait.")


class Config(_Section):
    task: str | None = None       # module:Class of a spmd.Task (resolved from model.name if unset)
    run: RunConfig = RunConfig()
    model: SerializeAsAny[BaseModel] = ModelConfig()  # validated by the task's own Config
    mesh: MeshConfig = MeshConfig()
    train: TrainConfig = TrainConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    schedule: ScheduleConfig = ScheduleConfig()
    data: DataConfig = DataConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    launch: LaunchConfig = LaunchConfig()

    @model_validator(mode="before")
    @classmethod
    def _deprecated_keys(cls, data: Any) -> Any:
        return migrate_deprecated(data)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json", by_alias=True), sort_keys=False)
