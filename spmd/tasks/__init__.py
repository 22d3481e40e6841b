"""Tasks: model + loss + batch layout + data source, one module per model family."""

from spmd.tasks.base import BatchField, DataSource, Task, make_task

__all__ = ["BatchField", "DataSource", "Task", "make_task"]
