"""Finding a task class: `task: module:Class` anywhere on the import path, or a registered name.

Names come from the `spmd.tasks` entry-point group, the same path for the built-in
transformer, mlp and fno (declared in spmd's own pyproject) as for an installed plugin.
The working directory is importable, as with `python -m`. Every failure is one line that
names the config key to fix.
"""

from __future__ import annotations

import importlib
import os
import sys
from importlib import metadata

from spmd.errors import ConfigError
from spmd.tasks.base import Task

ENTRY_POINT_GROUP = "spmd.tasks"
DEFAULT_TASK = "transformer"
# Built-in task modules that moved: a config.yaml written by an earlier run still resolves.
MOVED_MODULES = {"spmd.tasks.operator": "spmd.tasks.neural_operator",
                 "spmd.tasks.fields": "spmd.tasks.field_task"}


def registered_tasks() -> dict[str, str]:
    """Registered task names -> `module:Class`, from installed packages' entry points."""
    return {ep.name: ep.value for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}


def _ensure_cwd_importable() -> None:
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)


def import_task(path: str, key: str = "task"):
    """The `spmd.Task` subclass at `module:Class` (or `module.Class`)."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(f"{key}: '{path}' is not of the form module:Class "
                          f"(e.g. my_project.tasks:HeatTask)")
    module_name = MOVED_MODULES.get(module_name, module_name)
    _ensure_cwd_importable()
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"{key}: cannot import module '{module_name}' of '{path}' ({e}); "
                          f"it must be importable from the working directory or PYTHONPATH"
                          ) from None
    except Exception as e:  # the user's module raised while importing
        raise ConfigError(f"{key}: importing '{module_name}' failed: "
                          f"{type(e).__name__}: {e}") from None
    cls = getattr(module, attr, None)
    if cls is None:
        raise ConfigError(f"{key}: module '{module_name}' has no attribute '{attr}'")
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise ConfigError(f"{key}: '{path}' is {type(cls).__name__} {cls!r}, "
                          f"not a subclass of spmd.Task")
    return cls


def task_path(cls: type) -> str:
    """The `module:Class` that imports `cls` again (written to the resolved config.yaml)."""
    return f"{cls.__module__}:{cls.__qualname__}"


def resolve_task(task: str | None, model_name: str | None):
    """The task class for a config's `task:` (a path or a registered name) or `model.name`."""
    if task:
        if ":" in task or "." in task:
            return import_task(task, "task")
        key, name = "task", task
    else:
        key, name = "model.name", model_name or DEFAULT_TASK
    known = registered_tasks()
    if name not in known:
        names = ", ".join(sorted(known)) or "none: is spmd installed (pip install -e .)?"
        raise ConfigError(f"{key}: '{name}' is not a registered task (registered: {names}); "
                          f"name your own as task: module:Class")
    return import_task(known[name], f"{key}={name} (entry point {known[name]})")
