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
    """Which tiers a step is due for. 0 disables a tier; `force` means every enabled tier."""

    local_every: int
    persistent_every: int

    def local_due(self, step: int, force: bool) -> bool:
        return self.local_every > 0 and (force or step % self.local_every == 0)

    def persistent_due(self, step: int, force: bool) -> bool:
        return self.persistent_every > 0 and (force or step % self.persistent_every == 0)
