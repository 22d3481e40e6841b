"""Tasks: model + loss + batch layout + data source + config, one module per model family.

Owns the `Task` interface a user subclasses (`base`), finding a task by `module:Class` or
registered name (`registry`), the built-in tasks and the figures a task draws (`figures`),
and `ModelConfig`, the base of every task's `model:` section (`base`). May import
`spmd.data`, `spmd.models`, `spmd.sharding`, `spmd.optim`; never the engine, the loop or
`spmd.config` (which assembles the run's `Config` and imports this layer to validate
`model:`; `Task.cfg` is typed against it under `TYPE_CHECKING` only).
"""

from spmd.data.batch import BatchField, DataSource
from spmd.tasks.base import ModelConfig, Task
from spmd.tasks.registry import import_task, registered_tasks, resolve_task

__all__ = ["BatchField", "DataSource", "ModelConfig", "Task", "import_task",
           "registered_tasks", "resolve_task"]
