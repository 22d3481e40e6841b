"""Finding a task class: `task: module:Class` anywhere on the import path, or a registered name.

Names come from the `spmd.tasks` entry-point group, the same path for the built-in
transformer, mlp and fno (declared in spmd's own pyproject) as for an installed plugin.
The working directory is importable, as with `python -m`. Every failure is one line that
names the config key to fix.

A task class defined in a script (`python train_heat.py` calling `spmd.train(cfg,
task=HeatTask)`) lives in `__main__`, which a later process cannot import by that name.
`task_path` records the script instead: its module path from the working directory
(`scripts.train_heat:HeatTask`) or else its file (`/abs/train_heat.py:HeatTask`), imported
without running its `if __name__ == "__main__":` block. A class no process can import again
(a notebook's, a function's local class) is recorded as `<__main__>:Class`, and resolving
that is a one-line error that says to set `task:`.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

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


# Prefix of a recorded task that no new process can import (see task_path).
UNIMPORTABLE = "<__main__>"
_importing: list[str] = []     # task paths being imported now (innermost last)


def importing_task() -> str | None:
    """The task path whose module is being imported by `import_task`, or None.

    `spmd.train` refuses to start while it is set: a script that trains at import time
    (outside `if __name__ == "__main__":`) would otherwise start a second run inside the
    import that resolves its task.
    """
    return _importing[-1] if _importing else None


@contextlib.contextmanager
def _importing_path(path: str) -> Iterator[None]:
    _importing.append(path)
    try:
        yield
    finally:
        _importing.pop()


def _import_file(file: Path, path: str, key: str):
    """The module of a task recorded as `file.py:Class`, under a name that is not __main__."""
    if not file.is_file():
        raise ConfigError(f"{key}: '{path}': the script {file} does not exist (moved?); set "
                          f"{key} to its new path, or to module:Class")
    name = "spmd_task_file." + "_".join(file.resolve().with_suffix("").parts[1:])
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


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
    if module_name == UNIMPORTABLE:
        raise ConfigError(f"{key}: '{path}' was defined in a notebook, an interactive session "
                          f"or a function, which a new process cannot import; set {key}: "
                          f"module:Class (or path/to/script.py:Class) to a file that defines it")
    module_name = MOVED_MODULES.get(module_name, module_name)
    _ensure_cwd_importable()
    try:
        with _importing_path(path):
            if module_name.endswith(".py"):
                module = _import_file(Path(module_name).expanduser(), path, key)
            else:
                module = importlib.import_module(module_name)
    except ConfigError:
        raise
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
    """The `module:Class` that imports `cls` again (written to the resolved config.yaml).

    For a class of `__main__`: the script's module path from the working directory, else
    the script's absolute `file.py:Class`, else `<__main__>:Class` (see the module docstring).
    """
    name = cls.__qualname__
    if "<locals>" in name:
        return f"{UNIMPORTABLE}:{name}"
    if cls.__module__ != "__main__":
        return f"{cls.__module__}:{name}"
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    if not main_file or not main_file.endswith(".py"):
        return f"{UNIMPORTABLE}:{name}"
    script = Path(main_file).resolve()
    try:
        parts = script.with_suffix("").relative_to(Path.cwd().resolve()).parts
    except ValueError:
        parts = ()
    if parts and all(p.isidentifier() for p in parts):
        return f"{'.'.join(parts)}:{name}"
    return f"{script}:{name}"


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
