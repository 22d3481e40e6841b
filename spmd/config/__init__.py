"""Configuration: the run's `Config` assembled from the sections of every layer (`schema`),
its loading (`load`: YAML, `key=value` overrides, the task) and its reference
(`reference`: docs/config.md, generated).

Owns no section: each lives next to the component that builds from it (`CheckpointConfig` in
spmd.checkpoint.policy, `DataConfig` in spmd.data.data_config, `MeshConfig`/`TrainConfig` in
spmd.engine.engine_config, `RunConfig` in spmd.rundir.run_config, `LaunchConfig` in
spmd.launch.launch_config, `ModelConfig` in spmd.tasks.base, `OptimizerConfig` and
`ScheduleConfig` in spmd.optim). This package sits above them and may import them, the tasks
(the `model:` section is validated by the task's own `Config`) and `spmd.errors`; the loop,
inference, tools and entry points import it. Names load lazily (`from spmd.config import
TrainConfig` imports only what it names).
"""

from __future__ import annotations

from spmd import lazy_exports

_PUBLIC = {
    "Config": "spmd.config.schema",
    "RunConfig": "spmd.rundir.run_config",
    "ProfileConfig": "spmd.rundir.run_config",
    "ModelConfig": "spmd.tasks.base",
    "MeshConfig": "spmd.engine.engine_config",
    "TrainConfig": "spmd.engine.engine_config",
    "EngineSections": "spmd.engine.engine_config",
    "DataConfig": "spmd.data.data_config",
    "WindowConfig": "spmd.data.data_config",
    "CheckpointConfig": "spmd.checkpoint.policy",
    "LaunchConfig": "spmd.launch.launch_config",
    "OptimizerConfig": "spmd.optim.optimizers",
    "ScheduleConfig": "spmd.optim.schedules",
    **{name: "spmd.config.load" for name in (
        "load_config", "config_from_dict", "with_overrides", "parse_overrides", "build_task",
        "task_class")},
}

__all__ = sorted(_PUBLIC)
__getattr__, __dir__ = lazy_exports(__name__, _PUBLIC)
