"""Loading a run configuration: YAML + dotted `key=value` overrides, validated once.

Unknown keys are errors that name the closest known key; every other problem names
the dotted key to fix, and where it was set: the YAML file (`configs/x.yaml: train.steps:
...`) or the command line, with the override as given (`command line: train.steps=abc:
...`). The core takes the resulting `Config`, never dicts. The `model:` section is
validated by the task's own `Config`, so loading resolves the task (`spmd.tasks.registry`).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from spmd.config.schema import CheckpointConfig, Config, LaunchConfig, RunConfig, migrate_deprecated
from spmd.errors import ConfigError
from spmd.tasks.registry import import_task, resolve_task, task_path


def task_class(cfg: Config) -> type:
    """The spmd.Task subclass named by the config's `task` key."""
    return import_task(cfg.task or "", "task")


def build_task(cfg: Config):
    """A fresh instance of the config's task, bound to this config."""
    return task_class(cfg)(cfg)



@dataclass(frozen=True)
class _Blame:
    """Where a dotted key was set: an override on the command line (named with its value, as
    given), else the config file `source`."""

    source: str
    overrides: Mapping[str, str] = field(default_factory=dict)  # dotted key -> "key=value"

    def override_of(self, dotted: str) -> str | None:
        """The override that set `dotted`, a key under it or the section above it."""
        for key, pair in self.overrides.items():
            if dotted == key or dotted.startswith(key + ".") or key.startswith(dotted + "."):
                return pair
        return None

    def prefix(self, dotted: str) -> str:
        pair = self.override_of(dotted)
        return f"command line: {pair}: " if pair is not None else f"{self.source}: "

    def line(self, dotted: str, msg: str) -> str:
        pair = self.override_of(dotted)
        if pair is not None:
            return f"command line: {pair}: {msg}"
        return f"{self.source}: {dotted or 'config'}: {msg}"


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


def _check_keys(raw: Any, cls: type[BaseModel], prefix: str, blame: _Blame) -> None:
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
                f"{blame.prefix(dotted)}unknown config key '{dotted}'{hint} (known keys under "
                f"'{prefix.rstrip('.') or 'top level'}': {', '.join(known)})"
            )
        sub = _section_class(cls, by_alias[key], value)
        if sub is not None:
            _check_keys(value, sub, dotted + ".", blame)


class ConfigLoader(yaml.SafeLoader):
    """YAML as `yaml.safe_load` reads it, except that a date the standard calendar lacks but
    another CF calendar has (2019-02-29, 2019-02-30: all_leap, 360_day) stays the string
    written; spmd.data.cf.calendars reads it in the data's calendar. A date no calendar has
    (2019-13-01, 2019-02-31) still fails."""


def _timestamp(loader: yaml.SafeLoader, node: yaml.Node) -> Any:
    try:
        return yaml.SafeLoader.construct_yaml_timestamp(loader, node)
    except ValueError:
        text = loader.construct_scalar(node)
        m = re.match(r"^\d{4}-(\d{1,2})-(\d{1,2})$", str(text))
        if m and 1 <= int(m.group(1)) <= 12 and 1 <= int(m.group(2)) <= 30:
            return text
        raise


ConfigLoader.add_constructor("tag:yaml.org,2002:timestamp", _timestamp)


def load_yaml(text: str) -> Any:
    """A config's YAML (ConfigLoader)."""
    return yaml.load(text, Loader=ConfigLoader)  # noqa: S506  (a SafeLoader)


def parse_overrides(pairs: list[str]) -> dict:
    """`["train.steps=5", "mesh.rules.mlp=null"]` -> nested dict with YAML-typed values."""
    out: dict = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"override '{pair}' is not of the form key=value")
        try:
            value = load_yaml(text) if text != "" else ""
        except (yaml.YAMLError, ValueError) as e:   # ValueError: an impossible date
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


def _format_validation(e: ValidationError, blame: _Blame, prefix: str = "") -> str:
    """One line per error, each naming the dotted key and where it was set."""
    lines = []
    for err in e.errors():
        loc = ".".join(str(p) for p in err["loc"] if not str(p).startswith("function-"))
        dotted = f"{prefix}{loc}" if loc else prefix.rstrip(".")
        line = blame.line(dotted, err["msg"]).rstrip(".")
        if line not in lines:
            lines.append(line)
    return "; ".join(lines)


def _sections_checked(raw: Any, source: str, blame: _Blame) -> dict:
    """A raw config as a mapping of sections, deprecated keys moved, every key known (the
    `model:` section's are its task's: `config_from_dict` checks them)."""
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{source}: top level must be a mapping of sections, got {type(raw).__name__}"
        )
    try:
        raw = migrate_deprecated(raw)
    except ValueError as e:
        raise ConfigError(f"{source}: {e}") from None
    _check_keys(raw, Config, "", blame)
    return raw


def config_from_dict(raw: dict, source: str = "<config>", task: type | None = None,
                     overrides: Mapping[str, str] | None = None) -> Config:
    """Validate a raw config; the `model:` section against its task's own `Config` class.

    The task is `task` when given (the Python API), else the config's `task: module:Class`,
    else the task registered under `model.name` (default: transformer). The resolved config
    names its task as `module:Class`, so its config.yaml reproduces the run on its own.
    `overrides` (dotted key -> the `key=value` given) are the keys set on the command line:
    their errors name the override, every other error names `source`.
    """
    blame = _Blame(source, dict(overrides or {}))
    raw = _sections_checked(raw, source, blame)
    model_raw = raw.get("model") or {}
    if not isinstance(model_raw, dict):
        raise ConfigError(f"{blame.prefix('model')}model: must be a mapping of the task's "
                          f"model keys, got {type(model_raw).__name__}")
    if "name" in model_raw and model_raw["name"] is None:  # a dumped Config() without a task
        model_raw = {k: v for k, v in model_raw.items() if k != "name"}
    try:
        cls = task or resolve_task(raw.get("task"), model_raw.get("name"))
    except ConfigError as e:
        key = "task" if blame.override_of("task") is not None else "model.name"
        raise ConfigError(f"{blame.prefix(key)}{e}") from None
    section = getattr(cls, "Config", None)
    if not (isinstance(section, type) and issubclass(section, BaseModel)):
        raise ConfigError(f"{source}: task {task_path(cls)}: its class attribute Config must be "
                          f"a pydantic model (subclass spmd.ModelConfig)")
    _check_keys(model_raw, section, "model.", blame)
    try:
        model = section.model_validate(model_raw)
    except ValidationError as e:
        raise ConfigError(_format_validation(e, blame, "model.")) from None
    try:
        return Config.model_validate({**raw, "task": task_path(cls), "model": model})
    except ValidationError as e:
        raise ConfigError(_format_validation(e, blame)) from None


def read_raw(path: str | Path | None, overrides: list[str] | None = None) -> tuple[dict, str]:
    """(raw config, source): the YAML at `path` (or nothing when None) with the overrides
    merged in, not yet validated; `source` names the file for errors."""
    raw: dict = {}
    source = "<defaults>"
    if path is not None:
        source = str(path)
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        text = p.read_text()
        try:
            raw = load_yaml(text) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {p} does not parse as YAML: {e}") from None
        except ValueError as e:     # YAML reads 2002-13-01 as a date, and fails to make it
            raise ConfigError(f"config file {p}: {_bad_scalar(text)}: {e}") from None
    if overrides:
        raw = with_overrides(raw if isinstance(raw, dict) else {}, overrides)
    return raw, source


def load_config(path: str | Path | None, overrides: list[str] | None = None,
                task: type | None = None) -> Config:
    """Read YAML at `path` (or defaults when None), apply overrides, validate.

    `task` (a spmd.Task subclass) takes precedence over the config's `task:` key.
    """
    raw, source = read_raw(path, overrides)
    return config_from_dict(raw, source, task, overridden(overrides))


@dataclass(frozen=True)
class RunSections:
    """The sections a process outside the ranks reads: where the run lives (`run`), its
    checkpoint tiers (`checkpoint`) and how its ranks are launched and ended (`launch`)."""

    run: RunConfig
    checkpoint: CheckpointConfig
    launch: LaunchConfig


def load_run_sections(path: str | Path | None,
                      overrides: list[str] | None = None) -> RunSections:
    """`run`, `checkpoint` and `launch` of a config, for `spmd run` and `spmd ckpt`: every
    section but `model:` checked as `load_config` checks it (unknown keys, values, where each
    was set), without resolving the task. The task's module, and with it JAX, is not
    imported: the ranks validate `model:` and `task:` when they load the config themselves."""
    raw, source = read_raw(path, overrides)
    blame = _Blame(source, overridden(overrides))
    raw = _sections_checked(raw, source, blame)
    try:
        cfg = Config.model_validate({k: v for k, v in raw.items() if k not in ("model", "task")})
    except ValidationError as e:
        raise ConfigError(_format_validation(e, blame)) from None
    return RunSections(cfg.run, cfg.checkpoint, cfg.launch)


def _bad_scalar(text: str) -> str:
    """Where a YAML scalar that parses but cannot be built (an impossible date) lies."""
    loader = ConfigLoader(text)
    try:
        nodes = [loader.get_single_node()]
        while nodes:
            node = nodes.pop()
            if isinstance(node, yaml.ScalarNode):
                try:
                    loader.construct_object(node, deep=True)
                except ValueError:
                    return f"line {node.start_mark.line + 1}, value {node.value!r}"
            elif isinstance(node, yaml.MappingNode):
                nodes.extend(v for kv in node.value for v in kv)
            elif isinstance(node, yaml.SequenceNode):
                nodes.extend(node.value)
    finally:
        loader.dispose()
    return "a value"


def overridden(overrides: list[str] | None) -> dict[str, str]:
    """Dotted key -> the `key=value` override as given, for `config_from_dict` to blame an
    error on the command line (the last override of a key wins, as in `with_overrides`)."""
    return {pair.partition("=")[0].strip(): pair for pair in overrides or []}


def with_overrides(raw: dict, overrides: list[str]) -> dict:
    """`raw` with dotted `key=value` overrides merged in (a new dict)."""
    return _merge(raw, parse_overrides(overrides))
