"""The run's `Config`: the sections of every layer, assembled (a run's YAML, key by key).

Each section lives next to the component that builds from it, and is documented there
(docs/config.md is generated from these models: `python -m spmd.config.reference`):

    run:        spmd.rundir.run_config      RunConfig, ProfileConfig
    model:      spmd.tasks.base             ModelConfig (validated by the task's own Config)
    mesh:       spmd.engine.engine_config   MeshConfig
    train:      spmd.engine.engine_config   TrainConfig
    optimizer:  spmd.optim.optimizers       OptimizerConfig
    schedule:   spmd.optim.schedules        ScheduleConfig
    data:       spmd.data.data_config       DataConfig, WindowConfig
    checkpoint: spmd.checkpoint.policy      CheckpointConfig
    launch:     spmd.launch.launch_config   LaunchConfig

This package sits above them all and only assembles: components are handed their own
sections (`CheckpointConfig`, `EngineSections`, ...), never the whole `Config`. Reading
YAML, overrides and resolving the task live in `spmd.config.load`.
"""

from __future__ import annotations

import logging
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, SerializeAsAny, model_validator

from spmd.checkpoint.policy import CheckpointConfig
from spmd.data.data_config import DataConfig, SourceSections, WindowConfig
from spmd.engine.engine_config import EngineSections, MeshConfig, TrainConfig
from spmd.launch.launch_config import LaunchConfig
from spmd.optim.optimizers import OptimizerConfig
from spmd.optim.schedules import ScheduleConfig
from spmd.rundir.run_config import ProfileConfig, RunConfig
from spmd.tasks.base import ModelConfig

__all__ = ["Config", "RunConfig", "ProfileConfig", "ModelConfig", "MeshConfig", "TrainConfig",
           "OptimizerConfig", "ScheduleConfig", "DataConfig", "WindowConfig",
           "CheckpointConfig", "LaunchConfig", "EngineSections", "DEPRECATED_KEYS",
           "migrate_deprecated"]

log = logging.getLogger("spmd.config")

# Keys of `train:` that moved (spmd 0.x): old key -> (section, key). Still read, for one
# release, with a warning naming the new key.
DEPRECATED_KEYS: dict[str, tuple[str, str]] = {
    "lr": ("optimizer", "lr"),
    "warmup_steps": ("schedule", "warmup_steps"),
    "weight_decay": ("optimizer", "weight_decay"),
    "grad_clip": ("optimizer", "grad_clip"),
}
_warned: set[str] = set()


def migrate_deprecated(raw: Any, warn: bool = True) -> Any:
    """A raw config (dict) with the deprecated `train.*` keys moved to their new sections,
    each warned about once per process (`warn`); both the old and the new key set is an
    error."""
    if not isinstance(raw, dict) or not isinstance(raw.get("train"), dict):
        return raw
    train = dict(raw["train"])
    moved = [k for k in DEPRECATED_KEYS if k in train]
    if not moved:
        return raw
    raw = dict(raw)
    for old in moved:
        section, key = DEPRECATED_KEYS[old]
        value = train.pop(old)
        target = raw.get(section)
        if target is None:
            target = {}
        elif isinstance(target, BaseModel):
            target = target.model_dump(exclude_unset=True)
        if not isinstance(target, dict):
            continue   # the section's own validation names the problem
        if key in target:
            raise ValueError(f"train.{old} is deprecated and {section}.{key} is set too: "
                             f"remove train.{old}")
        raw[section] = {**target, key: value}
        if warn and old not in _warned:
            _warned.add(old)
            log.warning("config key train.%s is deprecated (read for one more release): use "
                        "%s.%s", old, section, key)
    raw["train"] = train
    return raw


class Config(BaseModel):
    """A run's configuration: one section per component."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    task: str | None = Field(
        None, description="`module:Class` of a spmd.Task (or a registered name); unset: the "
        "task registered as model.name.")
    run: RunConfig = RunConfig()
    model: SerializeAsAny[BaseModel] = Field(
        ModelConfig(), description="The task's own section, validated by its `Config` class.")
    mesh: MeshConfig = MeshConfig()
    train: TrainConfig = TrainConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    schedule: ScheduleConfig = ScheduleConfig()
    data: DataConfig = DataConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    launch: LaunchConfig = LaunchConfig()

    @model_validator(mode="before")
    @classmethod
    def _deprecated_keys(cls, data: Any) -> Any:
        return migrate_deprecated(data)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json", by_alias=True), sort_keys=False)

    def engine_sections(self) -> EngineSections:
        """What the engine reads: mesh, train, optimizer, schedule."""
        return EngineSections(self.mesh, self.train, self.optimizer, self.schedule)

    def source_sections(self) -> SourceSections:
        """What a data source reads: the `data:` section, the batch size, the seed and the
        steps of `train:`, and the task's name for its errors."""
        return SourceSections(self.data, batch_size=self.train.batch_size,
                              seed=self.train.seed, steps=self.train.steps,
                              task=self.task or getattr(self.model, "name", None) or "(unnamed)")
