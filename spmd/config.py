"""Typed run configuration: YAML + dotted `key=value` overrides, validated once.

Unknown keys are errors that name the closest known key; every other problem names
the dotted key to fix. The core takes the resulting `Config`, never dicts.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, SerializeAsAny, ValidationError

from spmd.errors import ConfigError


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RunConfig(_Section):
    dir: Path = Path("runs/default")
    log_every: int = Field(1, ge=1)
    progress: bool = True
    plots: bool = True        # rank 0 writes run.dir/plots/*.png when training ends
    # A run.dir lease held from another host without a heartbeat this long is taken over.
    lease_stale_s: float = Field(300.0, gt=0)
    # JAX's persistent compilation cache: a requeued or resumed job loads its compiled
    # steps from here instead of compiling again (null: off, or JAX_COMPILATION_CACHE_DIR).
    compilation_cache: Path | None = None


class ModelConfig(BaseModel):
    """Base of a task's `model:` section (its class attribute `Task.Config`): strict, frozen.

    `name` is optional for a task named by `task: module:Class`; a registered task's name
    (e.g. `fno`) selects it when `task:` is absent.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str | None = None


class MeshConfig(_Section):
    strategy: Literal["dp", "fsdp", "tp", "fsdp_tp", "sp", "pp", "pp_fsdp", "spatial"] = "dp"
    # Sizes per mesh axis; one -1 absorbs the rest. Missing axes take the preset's value or 1.
    axes: dict[str, int] = Field(default_factory=dict)
    # Single-entry overrides of the preset's rule table: logical -> axis | [axes] | null.
    rules: dict[str, str | list[str] | None] = Field(default_factory=dict)
    max_replicated_fraction: float | None = Field(None, ge=0.0, le=1.0)


class TrainConfig(_Section):
    steps: int = Field(10, ge=0)
    batch_size: int = Field(8, ge=1)
    seed: int = 0
    lr: float = Field(1e-3, gt=0)
    warmup_steps: int = Field(0, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float | None = Field(1.0, gt=0)
    eval_every: int = Field(0, ge=0)
    donate: bool = True
    # Pipelined strategies (layers on stage): microbatches per step and their schedule;
    # repeats > 1 is a circular gpipe (stage k runs layer chunks k, k + S, ...).
    microbatches: int = Field(1, ge=1)
    pipeline_schedule: Literal["gpipe", "1f1b"] = "gpipe"
    pipeline_repeats: int = Field(1, ge=1)


class DataConfig(_Section):
    source: Literal["synthetic", "hdf5", "npy"] = "synthetic"
    path: Path | None = None          # hdf5: dataset file (made by `spmd data make` if missing)
    # batch field -> dataset path in data.path ("{split}" stands for train / test); fields
    # not named here take the task's default path (spmd.data.ArraySource)
    fields: dict[str, str] = Field(default_factory=dict)
    num_train: int = Field(1000, ge=1)
    num_test: int = Field(100, ge=1)
    eval_batches: int = Field(2, ge=1)
    seed: int = Field(0, ge=0)        # generator seed of a dataset made by `spmd data make`
    solver: dict[str, Any] = Field(default_factory=dict)


class CheckpointConfig(_Section):
    every: int = Field(0, ge=0)            # steps between node-local saves (0 = never)
    persistent_every: int = Field(0, ge=0)  # steps between persistent-tier saves (0 = never)
    local_dir: Path | None = None           # node-local tier; None = <run.dir>/local
    persistent_dir: Path | None = None      # None = <run.dir>/checkpoints
    keep: int = Field(2, ge=1)
    partner: bool | None = None             # None = on when there is more than one node
    async_: bool = Field(True, alias="async")
    timeout_s: float = Field(600.0, gt=0)
    compress: bool = False                  # zstd in the persistent tier (Orbax's default: on)
    # What a save blocks for: auto | alias (CPU: zero-copy views, as Orbax) | host (D2H into
    # reused host buffers) | pinned (D2H into pinned host memory) | device (on-device copy,
    # D2H in the background). See spmd/checkpoint/snapshot.py.
    snapshot: Literal["auto", "alias", "host", "pinned", "device"] = "auto"

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class LaunchConfig(_Section):
    init_timeout_s: float = Field(300.0, gt=0)
    heartbeat_timeout_s: float = Field(100.0, gt=0)
    barrier_timeout_s: float = Field(300.0, gt=0)
    # Stop (and save) this many seconds before the allocation's known end time.
    walltime_margin_s: float = Field(300.0, ge=0)


class Config(_Section):
    task: str | None = None       # module:Class of a spmd.Task (resolved from model.name if unset)
    run: RunConfig = RunConfig()
    model: SerializeAsAny[BaseModel] = ModelConfig()  # validated by the task's own Config
    mesh: MeshConfig = MeshConfig()
    train: TrainConfig = TrainConfig()
    data: DataConfig = DataConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    launch: LaunchConfig = LaunchConfig()

    def task_class(self) -> type:
        """The spmd.Task subclass named by `task` (imported on first use)."""
        from spmd.tasks.registry import import_task

        return import_task(self.task or "", "task")

    def build_task(self):
        """A fresh instance of the config's task, bound to this config."""
        return self.task_class()(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json", by_alias=True), sort_keys=False)


# ---------------------------------------------------------------- loading


def _section_class(cls: type[BaseModel], key: str, raw_value: Any) -> type[BaseModel] | None:
    """The pydantic class for `cls.key` if it is a section (resolving the model union)."""
    if cls is Config and key == "model":
        return None  # checked against the task's own Config (config_from_dict)
    annotation = cls.model_fields[key].annotation
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def _known_keys(cls: type[BaseModel]) -> list[str]:
    return [f.alias or name for name, f in cls.model_fields.items()]


def _check_keys(raw: Any, cls: type[BaseModel], prefix: str) -> None:
    if not isinstance(raw, dict):
        return
    known = _known_keys(cls)
    by_alias = {(f.alias or n): n for n, f in cls.model_fields.items()}
    for key, value in raw.items():
        dotted = f"{prefix}{key}"
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.5)
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else ""
            raise ConfigError(
                f"unknown config key '{dotted}'{hint} (known keys under "
                f"'{prefix.rstrip('.') or 'top level'}': {', '.join(known)})"
            )
        sub = _section_class(cls, by_alias[key], value)
        if sub is not None:
            _check_keys(value, sub, dotted + ".")


def parse_overrides(pairs: list[str]) -> dict:
    """`["train.steps=5", "mesh.rules.mlp=null"]` -> nested dict with YAML-typed values."""
    out: dict = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"override '{pair}' is not of the form key=value")
        try:
            value = yaml.safe_load(text) if text != "" else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"override '{pair}': value does not parse as YAML: {e}") from None
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override '{pair}' conflicts with an earlier override")
        node[parts[-1]] = value
    return out


def _merge(base: dict, extra: dict) -> dict:
    merged = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _format_validation(e: ValidationError, prefix: str = "") -> str:
    lines = []
    for err in e.errors():
        loc = ".".join(str(p) for p in err["loc"] if not str(p).startswith("function-"))
        lines.append(f"{prefix}{loc or 'config'}: {err['msg']}".rstrip("."))
    return "; ".join(lines)


def config_from_dict(raw: dict, source: str = "<config>", task: type | None = None) -> Config:
    """Validate a raw config; the `model:` section against its task's own `Config` class.

    The task is `task` when given (the Python API), else the config's `task: module:Class`,
    else the task registered under `model.name` (default: transformer). The resolved config
    names its task as `module:Class`, so its config.yaml reproduces the run on its own.
    """
    from spmd.tasks.registry import resolve_task, task_path

    if not isinstance(raw, dict):
        raise ConfigError(
            f"{source}: top level must be a mapping of sections, got {type(raw).__name__}"
        )
    _check_keys(raw, Config, "")
    model_raw = raw.get("model") or {}
    if not isinstance(model_raw, dict):
        raise ConfigError(f"{source}: model: must be a mapping of the task's model keys, "
                          f"got {type(model_raw).__name__}")
    if "name" in model_raw and model_raw["name"] is None:  # a dumped Config() without a task
        model_raw = {k: v for k, v in model_raw.items() if k != "name"}
    try:
        cls = task or resolve_task(raw.get("task"), model_raw.get("name"))
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    section = getattr(cls, "Config", None)
    if not (isinstance(section, type) and issubclass(section, BaseModel)):
        raise ConfigError(f"{source}: task {task_path(cls)}: its class attribute Config must be "
                          f"a pydantic model (subclass spmd.ModelConfig)")
    _check_keys(model_raw, section, "model.")
    try:
        model = section.model_validate(model_raw)
    except ValidationError as e:
        raise ConfigError(f"{source}: {_format_validation(e, 'model.')}") from None
    try:
        return Config.model_validate({**raw, "task": task_path(cls), "model": model})
    except ValidationError as e:
        raise ConfigError(f"{source}: {_format_validation(e)}") from None


def load_config(path: str | Path | None, overrides: list[str] | None = None,
                task: type | None = None) -> Config:
    """Read YAML at `path` (or defaults when None), apply overrides, validate.

    `task` (a spmd.Task subclass) takes precedence over the config's `task:` key.
    """
    raw: dict = {}
    source = "<defaults>"
    if path is not None:
        source = str(path)
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        try:
            raw = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {p} does not parse as YAML: {e}") from None
    if overrides:
        raw = with_overrides(raw if isinstance(raw, dict) else {}, overrides)
    return config_from_dict(raw, source, task)


def with_overrides(raw: dict, overrides: list[str]) -> dict:
    """`raw` with dotted `key=value` overrides merged in (a new dict)."""
    return _merge(raw, parse_overrides(overrides))
