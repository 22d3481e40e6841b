"""Typed run configuration: YAML + dotted `key=value` overrides, validated once.

Unknown keys are errors that name the closest known key; every other problem names
the dotted key to fix. The core takes the resulting `Config`, never dicts.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from spmd.errors import ConfigError


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RunConfig(_Section):
    dir: Path = Path("runs/default")
    log_every: int = Field(1, ge=1)
    progress: bool = True
    plots: bool = True        # rank 0 writes run.dir/plots/*.png when training ends


class TransformerConfig(_Section):
    name: Literal["transformer"] = "transformer"
    num_layers: int = Field(2, ge=1)
    d_model: int = Field(64, ge=1)
    num_heads: int = Field(4, ge=1)
    d_ff: int = Field(256, ge=1)
    vocab_size: int = Field(256, ge=2)
    seq_len: int = Field(32, ge=2)
    positions: Literal["rotary", "learned"] = "rotary"
    dtype: Literal["float32", "bfloat16"] = "float32"

    @model_validator(mode="after")
    def _heads_divide(self) -> TransformerConfig:
        if self.d_model % self.num_heads:
            raise ValueError(
                f"model.d_model={self.d_model} is not divisible by model.num_heads={self.num_heads}"
            )
        return self


class MlpConfig(_Section):
    name: Literal["mlp"] = "mlp"
    d_in: int = Field(32, ge=1)
    d_hidden: int = Field(128, ge=1)
    d_out: int = Field(8, ge=1)
    num_layers: int = Field(2, ge=1)
    dtype: Literal["float32", "bfloat16"] = "float32"


class FnoConfig(_Section):
    name: Literal["fno"] = "fno"
    in_channels: int = Field(1, ge=1)
    out_channels: int = Field(1, ge=1)
    width: int = Field(32, ge=1)
    modes: int = Field(12, ge=1)
    num_layers: int = Field(4, ge=1)
    grid: int = Field(64, ge=4)
    projection: int = Field(128, ge=1)   # hidden channels of the output projection
    dtype: Literal["float32", "bfloat16"] = "float32"

    @model_validator(mode="after")
    def _modes_fit(self) -> FnoConfig:
        if 2 * self.modes > self.grid:
            raise ValueError(
                f"model.modes={self.modes} needs model.grid >= {2 * self.modes} "
                f"(got {self.grid}): a Fourier layer keeps modes x modes frequencies per half"
            )
        return self


ModelConfig = Annotated[TransformerConfig | MlpConfig | FnoConfig, Field(discriminator="name")]
MODEL_CONFIGS: dict[str, type[_Section]] = {
    "transformer": TransformerConfig, "mlp": MlpConfig, "fno": FnoConfig,
}


class MeshConfig(_Section):
    strategy: Literal["dp", "fsdp", "tp", "fsdp_tp", "sp", "spatial"] = "dp"
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


class DataConfig(_Section):
    source: Literal["synthetic", "hdf5"] = "synthetic"
    path: Path | None = None          # hdf5: dataset file (made by `spmd data make` if missing)
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
    # What a save blocks for: auto | host (D2H into reused host buffers) | pinned (D2H into
    # pinned host memory) | device (on-device copy, D2H in the background). See
    # spmd/checkpoint/snapshot.py.
    snapshot: Literal["auto", "host", "pinned", "device"] = "auto"

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class LaunchConfig(_Section):
    init_timeout_s: float = Field(300.0, gt=0)
    heartbeat_timeout_s: float = Field(100.0, gt=0)
    barrier_timeout_s: float = Field(300.0, gt=0)
    # Stop (and save) this many seconds before the allocation's known end time.
    walltime_margin_s: float = Field(300.0, ge=0)


class Config(_Section):
    run: RunConfig = RunConfig()
    model: ModelConfig = TransformerConfig()
    mesh: MeshConfig = MeshConfig()
    train: TrainConfig = TrainConfig()
    data: DataConfig = DataConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    launch: LaunchConfig = LaunchConfig()

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json", by_alias=True), sort_keys=False)


# ---------------------------------------------------------------- loading


def _section_class(cls: type[BaseModel], key: str, raw_value: Any) -> type[BaseModel] | None:
    """The pydantic class for `cls.key` if it is a section (resolving the model union)."""
    if cls is Config and key == "model":
        name = raw_value.get("name", "transformer") if isinstance(raw_value, dict) else None
        return MODEL_CONFIGS.get(name)
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


def _format_validation(e: ValidationError) -> str:
    lines = []
    for err in e.errors():
        loc = ".".join(str(p) for p in err["loc"] if not str(p).startswith("function-"))
        loc = loc.replace("model.transformer", "model").replace("model.mlp", "model")
        loc = loc.replace("model.fno", "model")
        lines.append(f"{loc or 'config'}: {err['msg']}")
    return "; ".join(lines)


def config_from_dict(raw: dict, source: str = "<config>") -> Config:
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{source}: top level must be a mapping of sections, got {type(raw).__name__}"
        )
    _check_keys(raw, Config, "")
    model = raw.get("model")
    if isinstance(model, dict) and "name" not in model:
        raw = {**raw, "model": {"name": "transformer", **model}}
        model = raw["model"]
    if isinstance(model, dict) and model.get("name") not in MODEL_CONFIGS:
        raise ConfigError(
            f"{source}: model.name '{model.get('name')}' is not one of {', '.join(MODEL_CONFIGS)}"
        )
    try:
        return Config.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(f"{source}: {_format_validation(e)}") from None


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """Read YAML at `path` (or defaults when None), apply overrides, validate."""
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
        raw = _merge(raw if isinstance(raw, dict) else {}, parse_overrides(overrides))
    return config_from_dict(raw, source)
