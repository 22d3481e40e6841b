"""The `checkpoint:` section, where each tier lives and when it is due (shared by the
checkpointer and `spmd ckpt`).

`CheckpointConfig` lives here, next to the policy built from it; this module imports nothing
of spmd (pydantic only), and `spmd.config` assembles the section into the run's `Config`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class CheckpointConfig(BaseModel):
    """checkpoint: the two tiers (node-local, persistent), when each is written and what a
    save blocks for (docs/checkpointing.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    every: int = Field(0, ge=0, description="Steps between node-local saves (0: never).")
    persistent_every: int = Field(
        0, ge=0, description="Steps between persistent-tier saves (0: never).")
    final: bool = Field(
        True, description="The last step of a run that ends (finished, or stopped by a hook) "
        "is committed to the persistent tier whatever `every` and `persistent_every` say, so "
        "that every finished run is loadable (spmd.load, spmd eval/predict/export). false: no "
        "such final save.")
    local_dir: Path | None = Field(
        None, description="The node-local tier (/dev/shm, NVMe, burst buffer; $VARS and ~ "
        "expand, e.g. /mnt/bb/$USER/$SLURM_JOB_ID). null: run.dir/local.")
    persistent_dir: Path | None = Field(
        None, description="The persistent tier. null: run.dir/checkpoints.")
    keep: int = Field(
        2, ge=1, description="Steps kept per tier (plus the newest with finite parameters).")
    partner: bool | None = Field(
        None, description="Partner copies of the node-local tier on another node. null: on "
        "when there is more than one node.")
    async_: bool = Field(
        True, alias="async", description="Write in the background while training goes on.")
    timeout_s: float = Field(
        600.0, gt=0, description="The bound on every checkpoint wait, in seconds.")
    compress: bool = Field(
        False, description="zstd in the persistent tier (Orbax's default: on).")
    persistent_file_mb: int | None = Field(
        None, ge=1, description="Target size of the persistent tier's data files (OCDBT), in "
        "MiB. null: a process's share of the state (its size over the process count) over 8, "
        "between 16 and 2048 MiB, so that several files are written and fsynced at once. On "
        "a parallel file system where many files cost more than large ones, raise it.")
    snapshot: Literal["auto", "alias", "host", "pinned", "device"] = Field(
        "auto", description="What a save blocks for: auto | alias (CPU: zero-copy views, as "
        "Orbax) | host (D2H into reused host buffers) | pinned (D2H into pinned host memory) | "
        "device (on-device copy, D2H in the background). See spmd/checkpoint/snapshot.py.")
    local_failure: Literal["continue", "stop"] = Field(
        "continue", description="A node-local save that fails (full or broken node-local "
        "disk): `continue` logs it and trains on, saving to the persistent tier; `stop` ends "
        "the run as any failed save does.")
    params_only: bool = Field(
        False, description="Resuming with a different optimizer.name than the run's previous "
        "job (its config.yaml): restore the parameters only, with a fresh optimizer state, and "
        "go on from the checkpoint's step. Without it such a resume is an error. With the same "
        "optimizer.name, the whole state is restored as always.")


def _expand(path: Path | str) -> Path:
    return Path(os.path.expandvars(os.path.expanduser(str(path)))).absolute()


def tier_dirs(ck: CheckpointConfig, run_dir: Path) -> tuple[Path, Path]:
    """(local_dir, persistent_dir) of a `checkpoint:` section; $VARS and ~ expanded.

    A tier the section does not place goes under `run_dir` (`run.dir`): `local/` and
    `checkpoints/`. `checkpoint.local_dir` may name node-local storage through the
    scheduler's variables, e.g. `/mnt/bb/$USER/$SLURM_JOB_ID` (NVMe) or `/dev/shm/$USER/myrun`
    (RAM).
    """
    run_dir = Path(run_dir)
    local = _expand(ck.local_dir) if ck.local_dir is not None else _expand(run_dir / "local")
    persistent = (_expand(ck.persistent_dir) if ck.persistent_dir is not None
                  else _expand(run_dir / "checkpoints"))
    return local, persistent


@dataclass(frozen=True)
class SavePolicy:
    """Which tiers a step is due for.

    0 disables a tier's periodic saves; `force` (a stopping run: preemption, wall time)
    means every tier that saves periodically, or the persistent tier when none does and
    `final` keeps it; `final` (checkpoint.final) commits the end of a run (`end`) to the
    persistent tier whatever the periods are.
    """

    local_every: int
    persistent_every: int
    final: bool = False

    @classmethod
    def of(cls, ck: CheckpointConfig) -> SavePolicy:
        return cls(ck.every, ck.persistent_every, ck.final)

    @property
    def uses_local(self) -> bool:
        return self.local_every > 0

    @property
    def uses_persistent(self) -> bool:
        return self.persistent_every > 0 or self.final

    @property
    def saves_anything(self) -> bool:
        return self.uses_local or self.uses_persistent

    def local_due(self, step: int, force: bool) -> bool:
        return self.local_every > 0 and (force or step % self.local_every == 0)

    def persistent_due(self, step: int, force: bool, end: bool = False) -> bool:
        if self.persistent_every > 0 and (force or end or step % self.persistent_every == 0):
            return True
        return self.final and (end or (force and not self.uses_local))
