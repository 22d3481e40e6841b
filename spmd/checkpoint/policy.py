"""Where each tier lives and when it is due (shared by the checkpointer and `spmd ckpt`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from spmd.config.schema import CheckpointConfig


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
