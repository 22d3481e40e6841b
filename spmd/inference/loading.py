"""`spmd.load(path)`: a trained model back in Python, on whatever devices are at hand.

A run directory (or one of its checkpoint directories) holds everything needed: its
`config.yaml` names the task and the model config, and its tiers hold the parameters.
`load` builds the task's model abstractly, resolves where each parameter goes on the mesh
it is given (one device by default: a notebook; or the run's own mesh, rebuilt with
`run_mesh`), reads the parameters only (spmd.checkpoint.params_reader) and merges them into
the task's `nnx.Module`, switched to eval mode. A run with `mesh.axis_types: explicit` (a
model written for JAX's explicit sharding) is loaded onto an explicit mesh: call its model
under `with jax.set_mesh(trained.mesh):`, as its `out_sharding=P(...)` needs. With
`ema=True` (default: the run's `train.eval_ema`) the model holds the run's EMA of the
parameters (train.ema_decay) instead.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from spmd.checkpoint.params_reader import (
    ParamsCheckpoint,
    choose_checkpoint,
    find_checkpoints,
    read_params,
)
from spmd.checkpoint.policy import CheckpointConfig, tier_dirs
from spmd.config.load import build_task, load_config
from spmd.config.schema import Config
from spmd.engine.axis_rules import axis_rules
from spmd.engine.engine_config import MeshConfig
from spmd.engine.mesh import AXIS_TYPES, build_mesh
from spmd.engine.state import ModelLayout, ema_as_params, ema_dtype, model_layout
from spmd.errors import SpmdError
from spmd.launch import LaunchEnv, bootstrap, shutdown
from spmd.sharding import MESH_AXES, RuleTable, state_shardings
from spmd.tasks import Task

log = logging.getLogger("spmd.inference")

CONFIG_NAME = "config.yaml"


@dataclass(frozen=True)
class Trained:
    """A trained model and what it came from.

    `model`: the task's module holding the trained parameters (eval mode); `params`: the
    same parameters as a pure dict of jax.Arrays (what jitted functions take); `layout`:
    the model's graph and sharding report, to rebuild the module from other parameters.
    `ema`: whether these are the EMA of the parameters (train.ema_decay) rather than the
    parameters themselves.
    """

    model: nnx.Module
    task: Task
    config: Config
    step: int
    source: str
    params: Any
    mesh: Mesh
    rules: RuleTable
    layout: ModelLayout
    ema: bool = False


@dataclass(frozen=True)
class RunLocation:
    """Where `path` points: the run directory, and maybe one tier or one step in it."""

    run_dir: Path
    tier_root: Path | None = None
    step: int | None = None


def locate(path: str | Path) -> RunLocation:
    """A run directory, a tier directory in it, or a step directory in a tier."""
    path = Path(path).expanduser()
    if (path / CONFIG_NAME).is_file():
        return RunLocation(path)
    if (path.parent / CONFIG_NAME).is_file():
        return RunLocation(path.parent, path)
    if path.name.isdigit() and (path.parent.parent / CONFIG_NAME).is_file():
        return RunLocation(path.parent.parent, path.parent, int(path.name))
    if not path.exists():
        raise SpmdError(f"{path} does not exist; give a run directory (run.dir of a training "
                        f"run) or one of its checkpoint directories")
    raise SpmdError(f"{path}: no {CONFIG_NAME} here or above it; give a run directory "
                    f"(run.dir of a training run, which holds {CONFIG_NAME}) or one of its "
                    f"checkpoint directories")


def run_config(where: RunLocation, overrides: list[str] | None = None) -> Config:
    """The run's resolved config.yaml, plus `overrides` (e.g. data.path on another machine).
    `run.dir` is where the run directory is now (it may have been moved or copied), unless
    an override sets it."""
    cfg = load_config(where.run_dir / CONFIG_NAME, overrides)
    if not any(o.split("=", 1)[0].strip() == "run.dir" for o in overrides or []):
        cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"dir": where.run_dir})})
    return cfg


def find_checkpoint(where: RunLocation, section: CheckpointConfig,
                    step: int | None) -> ParamsCheckpoint:
    """The checkpoint `where` and `step` select: the newest of both tiers (the run's
    `checkpoint:` section places them) by default."""
    if where.step is not None:
        if step is not None and step != where.step:
            raise SpmdError(f"{where.tier_root / str(where.step)} is step {where.step}, but "
                            f"step {step} was asked for")
        step = where.step
    local_dir, persistent_dir = tier_dirs(section, where.run_dir)
    if where.tier_root is not None:
        root = where.tier_root.absolute()
        found = [c for c in find_checkpoints(root, root) if c.path.parent == root]
        label = str(where.tier_root)
    else:
        found = find_checkpoints(persistent_dir, local_dir)
        label = f"{where.run_dir} (persistent tier {persistent_dir}, local tier {local_dir})"
    return choose_checkpoint(found, step, label)


def single_device_mesh(device: jax.Device | None = None, axis_types: str = "auto") -> Mesh:
    """A mesh of one device with every mesh axis (size 1): any rule table resolves on it.
    `axis_types`: the run's `mesh.axis_types` (a model written for explicit sharding names
    these axes in its PartitionSpecs, and needs them `AxisType.Explicit`)."""
    device = device or jax.devices()[0]
    grid = np.array([device], dtype=object).reshape((1,) * len(MESH_AXES))
    return Mesh(grid, MESH_AXES, axis_types=(AXIS_TYPES[axis_types],) * len(MESH_AXES))


def run_mesh(section: MeshConfig | Config, node_of_process: list[int] | None = None) -> Mesh:
    """The run's mesh (its `mesh:` section, or a run's `Config`'s) rebuilt over every device
    of this job."""
    if not isinstance(section, MeshConfig):
        section = section.mesh
    return build_mesh(section, jax.devices(), node_of_process)


def load(path: str | Path, step: int | None = None, *, mesh: Mesh | None = None,
         overrides: list[str] | None = None, verify: bool = True,
         ema: bool | None = None) -> Trained:
    """The trained model of a run directory (or checkpoint directory), on `mesh`.

    `step`: that committed step (default: the newest of the persistent tier and the local
    tier). `mesh`: where the parameters go (default: one device, every parameter whole on
    it); any mesh with spmd's axis names works, e.g. `run_mesh(cfg)`. `overrides`: dotted
    `key=value` changes to the run's config (a moved `data.path`, say). Only the parameters
    are read from disk, checked against their checksums unless `verify` is false. `ema`:
    the EMA of the parameters that a run with `train.ema_decay` keeps, instead of the
    parameters (default: the run's `train.eval_ema`, so that `spmd eval` evaluates what the
    run's evaluation did; an error if the step holds no EMA).
    """
    where = locate(path)
    cfg = run_config(where, overrides)
    ckpt = find_checkpoint(where, cfg.checkpoint, step)
    task = build_task(cfg)
    mesh = mesh if mesh is not None else single_device_mesh(axis_types=cfg.mesh.axis_types)
    rules = axis_rules(cfg.mesh, task)
    layout = model_layout(task, cfg.train.seed, rules, mesh)
    shardings = nnx.to_pure_dict(state_shardings(layout.abstract_params, rules, mesh))
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          nnx.to_pure_dict(layout.abstract_params), shardings)
    ema = cfg.train.eval_ema if ema is None else ema
    if ema:   # stored in the EMA's own dtype (float32), cast to the parameters' afterwards
        stored = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, ema_dtype(a.dtype),
                                                             sharding=a.sharding), target)
        params = ema_as_params(read_params(ckpt, stored, verify=verify, field="ema"), target)
    else:
        params = read_params(ckpt, target, verify=verify)
    model = layout.merge(params)   # in eval mode (Dropout off), RNG streams from a fixed key
    log.info("loaded %s: %s%s", cfg.task, "the EMA of the parameters of " if ema else "",
             ckpt.describe())
    return Trained(model=model, task=task, config=cfg, step=ckpt.step,
                   source=ckpt.describe(), params=params, mesh=mesh, rules=rules,
                   layout=layout, ema=ema)


@contextmanager
def trained_job(path: str | Path, step: int | None = None,
                overrides: list[str] | None = None) -> Iterator[tuple[Trained, LaunchEnv]]:
    """`load` onto the run's mesh over every device of this job, one call per rank.

    Bootstraps the rank as training does (srun, mpiexec, `spmd run --entry ...`, or one
    process), so `spmd eval` and `spmd predict` shard like the run, and shuts a
    multi-process job down when the block ends.
    """
    cfg = run_config(locate(path), overrides)
    env = bootstrap(init_timeout_s=cfg.launch.init_timeout_s,
                    heartbeat_timeout_s=cfg.launch.heartbeat_timeout_s)
    try:
        yield load(path, step, mesh=run_mesh(cfg.mesh, env.node_of_rank), overrides=overrides), env
    finally:
        if env.size > 1:
            shutdown()
