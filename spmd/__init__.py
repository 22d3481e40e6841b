"""spmd: train large scientific models with JAX on HPC supercomputers.

The public API, for a user's own model and task:

    import spmd
    from spmd.sharding import with_axes, constrain

    class MyTask(spmd.Task):
        class Config(spmd.ModelConfig): ...
    spmd.train("config.yaml", task=MyTask)
    trained = spmd.load("runs/my_run")         # .model, .task, .config, .step

Everything installs under this one import root (`spmd.sharding`, `spmd.launch`, `spmd.models`,
`spmd.jobscripts`), so a user's own `models/` or `launch/` folder never shadows spmd's. Names
below load lazily: `import spmd.launch` on a login node pulls in neither JAX nor Flax.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_PUBLIC = {
    "Task": "spmd.tasks.base",
    "FieldTask": "spmd.tasks.field_task",
    "TrajectoryTask": "spmd.tasks.trajectory_task",
    "GriddedTrajectoryTask": "spmd.tasks.gridded_task",
    "BatchField": "spmd.data.batch",
    "DataSource": "spmd.data.batch",
    "ModelConfig": "spmd.tasks.base",
    "Config": "spmd.config.schema",
    "load_config": "spmd.config.load",
    "Trainer": "spmd.loop.trainer",
    "StepInfo": "spmd.loop.hooks",
    "Stop": "spmd.loop.hooks",
    "TrainState": "spmd.engine.state",
    "train": "spmd.api",
    "load": "spmd.inference.loading",
    "Trained": "spmd.inference.loading",
}

def lazy_exports(package: str, table: dict[str, str]):
    """`__getattr__` and `__dir__` for a package whose public names (name -> module) load on
    first use, so importing the package pulls in none of their dependencies."""
    def getattr_(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module '{package}' has no attribute '{name}'")
        return getattr(importlib.import_module(module), name)

    def dir_() -> list[str]:
        return sorted({*vars(importlib.import_module(package)), *table})

    return getattr_, dir_


__all__ = sorted(_PUBLIC)
__getattr__, __dir__ = lazy_exports(__name__, _PUBLIC)
