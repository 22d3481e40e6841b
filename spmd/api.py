"""The Python entry point: `spmd.train(config, task=None)`, for scripts and notebooks.

The `spmd train` command is a thin caller of the same function, so a run started from
Python is the run the CLI would start: same bootstrap, checkpoints, hooks and run dir.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from spmd.config.load import (
    config_from_dict,
    load_config,
    overridden,
    task_class,
    with_overrides,
)
from spmd.config.schema import Config
from spmd.errors import ConfigError
from spmd.loop.hooks import Hook, HookFn
from spmd.tasks import Task


def as_config(config: Config | str | Path | dict | None, overrides: list[str] | None = None,
              task: type[Task] | None = None) -> Config:
    """A validated Config from a path, a dict, a Config or None (defaults), plus overrides."""
    if isinstance(config, Config):
        if not overrides and (task is None or task_class(config) is task):
            return config
        config = config.model_dump(mode="json", by_alias=True)
    if isinstance(config, dict):
        return config_from_dict(with_overrides(config, overrides or []), "<dict>", task,
                                overridden(overrides))
    return load_config(config, overrides, task)


def train(config: Config | str | Path | dict | None = None, task: type[Task] | Task | None = None,
          *, overrides: list[str] | None = None,
          hooks: Iterable[Hook | tuple[HookFn, int]] = (),
          debug: bool = False) -> int:
    """Train `config` (its `task:` or `task`) on this rank; returns the exit status.

    0: finished, or a hook returned `Stop(reason)`; 75: stopped for preemption after a save
    (resume by running it again). `hooks` are `Hook`s or `(fn, every)` pairs, called as
    `Trainer.add_hook` calls them; see spmd.loop.hooks for `StepInfo` and `Stop`.
    Under srun/mpiexec every rank calls this; alone it runs as one process.
    """
    from spmd.loop.trainer import Trainer
    from spmd.tasks.registry import importing_task

    if (resolving := importing_task()) is not None:
        raise ConfigError(f"task: importing '{resolving}' called spmd.train again; guard the "
                          f"script's call with if __name__ == \"__main__\":")
    instance = task if isinstance(task, Task) else None
    task_cls = type(task) if instance is not None else task
    cfg = as_config(config, overrides, task_cls)
    if instance is not None and instance.cfg is not cfg:
        instance = task_cls(cfg)
    trainer = Trainer(cfg, instance)
    for hook in hooks:
        if isinstance(hook, Hook):
            trainer.add_hook(hook.fn, every=hook.every, name=hook.name)
        else:
            fn, every = hook
            trainer.add_hook(fn, every=every)
    return trainer.run(debug)
