"""Tasks: model + loss + batch layout + data source + config, one module per model family.

Owns the `Task` interface a user subclasses (`base`), finding a task by `module:Class` or
registered name (`registry`), the built-in tasks and the figures a task draws (`figures`).
May import `spmd.data`, `spmd.models`, `spmd.sharding` and the config schema; never the
engine, the loop or config loading (which imports this layer to validate `model:`).
"""

from spmd.data.batch import BatchField, DataSource
from spmd.tasks.base import ModelConfig, Task
from spmd.tasks.registry import import_task, registered_tasks, resolve_task

__all__ = ["BatchField", "DataSource", "ModelConfig", "Task", "import_task",
           "registered_tasks", "resolve_task"]
