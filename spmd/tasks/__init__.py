"""Tasks: model + loss + batch layout + data source + config, one module per model family."""

from spmd.data.batch import BatchField, DataSource
from spmd.tasks.base import ModelConfig, Task
from spmd.tasks.registry import import_task, registered_tasks, resolve_task

__all__ = ["BatchField", "DataSource", "ModelConfig", "Task", "import_task",
           "registered_tasks", "resolve_task"]
