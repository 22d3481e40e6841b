"""The `run:` section (and its `run.profile:`): the run directory and what goes into it
(metrics cadence, plots, trackers, the lease, the compilation cache, a profiler trace).

It lives here, next to the run directory's lease, metrics, plots and trackers, and imports
nothing of spmd (pydantic only); `spmd.config` assembles it into the run's `Config`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class ProfileConfig(BaseModel):
    """run.profile: a JAX profiler trace of updates steps[0]..steps[1] (inclusive) on the
    ranks listed, in run.dir/profile/ (docs/observability.md). Off (no hook) without steps."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    steps: tuple[int, int] | None = Field(
        None, description="[start, stop]: the updates to trace (1 <= start <= stop, counted as "
        "in metrics.jsonl); null: no trace. `spmd profile` summarises it.")
    ranks: list[int] = Field(
        default_factory=lambda: [0], description="The ranks that write a trace.")

    @model_validator(mode="after")
    def _ordered(self) -> ProfileConfig:
        if self.steps is not None and not 1 <= self.steps[0] <= self.steps[1]:
            raise ValueError(f"run.profile.steps must be [start, stop] with 1 <= start <= stop "
                             f"(updates done, as in metrics.jsonl); got {list(self.steps)}")
        return self


class RunConfig(BaseModel):
    """run: the run directory and what rank 0 writes there."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dir: Path = Field(Path("runs/default"), description="Where everything of a run goes.")
    log_every: int = Field(1, ge=1, description="Steps between metrics records.")
    progress: bool = Field(True, description="Rank 0 shows a progress line.")
    log_level: Literal["info", "debug"] = Field(
        "info", description="info: the console shows rank 0's phases, progress and messages, "
        "and every rank's warnings and errors, while the internal `key=value` records go to "
        "the rank logs (run.dir/logs) and events.jsonl only; debug: the console shows those "
        "records too, and the rank logs get DEBUG records (`-v` on `spmd train` and `spmd "
        "run` sets it).")
    plots: bool = Field(
        True, description="Rank 0 writes run.dir/plots/*.png when training ends.")
    lease_stale_s: float = Field(
        300.0, gt=0, description="A run.dir lease held from another host without a heartbeat "
        "this long is taken over.")
    compilation_cache: Path | None = Field(
        None, description="JAX's persistent compilation cache: a requeued or resumed job loads "
        "its compiled steps from here instead of compiling again (put it on a file system "
        "every node reads). null: off, or JAX_COMPILATION_CACHE_DIR.")
    keep_executables: bool = Field(
        True, description="Each rank keeps its compiled train step in run.dir/executables "
        "(jax.experimental.serialize_executable, keyed by the program, the devices, the "
        "versions and XLA_FLAGS), so a new try or a resumed job on the same layout loads it "
        "instead of compiling (JAX's own cache serves only process 0 on CPU); with JAX's "
        "persistent cache on, also in its spmd-executables folder with the initializer, so "
        "another run of the same program loads them there. false: compile every time.")
    profile: ProfileConfig = ProfileConfig()
    trackers: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=list, description="Where rank 0 also sends every metrics.jsonl scalar "
        "and the resolved config: tensorboard (run.dir/tensorboard), wandb (offline), mlflow "
        "(run.dir/mlruns); the optional ones need their pip extra: spmd-hpc[wandb], "
        "spmd-hpc[mlflow].")
