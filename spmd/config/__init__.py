"""Configuration: the typed schema of a run (`schema`, a leaf) and its loading (`load`).

Owns: the pydantic sections every component is built from, YAML + `key=value` overrides,
strict validation with closest-key errors. `schema` imports nothing of spmd but
`spmd.errors` and `spmd.optim` (the `optimizer:` and `schedule:` sections live next to the
code that builds from them); `load` may import `spmd.tasks` (the `model:` section is
validated by the task's own `Config`). Names load lazily, so importing the schema never
pulls in a task (nor JAX: `spmd.optim` imports optax where it builds).
"""

from __future__ import annotations

from spmd import lazy_exports

_PUBLIC = {
    **{name: "spmd.config.schema" for name in (
        "Config", "RunConfig", "ModelConfig", "MeshConfig", "TrainConfig", "DataConfig",
        "CheckpointConfig", "LaunchConfig", "OptimizerConfig", "ScheduleConfig")},
    **{name: "spmd.config.load" for name in (
        "load_config", "config_from_dict", "with_overrides", "parse_overrides", "build_task",
        "task_class")},
}

__all__ = sorted(_PUBLIC)
__getattr__, __dir__ = lazy_exports(__name__, _PUBLIC)
