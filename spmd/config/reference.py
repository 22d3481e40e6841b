"""docs/config.md, generated from the pydantic models: every key (dotted), its type, default
and description, section by section, and the built-in tasks' `model:` sections.

The models are the one source of truth: a key is documented where it is declared, in its
`Field(description=...)`, next to the component that reads it. Regenerate after adding or
changing a key:

    python -m spmd.config.reference            # writes docs/config.md
    python -m spmd.config.reference --check    # exit 1 if docs/config.md is stale

(tests/unit/config/test_config_reference.py fails on a stale docs/config.md.)
"""

from __future__ import annotations

import argparse
import enum
import json
import sys
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from spmd.config.schema import DEPRECATED_KEYS, Config

# The built-in tasks whose `model:` sections are documented: name -> "module:Class".
BUILTIN_TASKS = {
    "transformer": "spmd.tasks.lm:LanguageModelTask",
    "mlp": "spmd.tasks.regression:RegressionTask",
    "fno": "spmd.tasks.neural_operator:OperatorTask",
}
DEFAULT_PATH = Path(__file__).resolve().parents[2] / "docs" / "config.md"
COMMAND = "python -m spmd.config.reference"

_BOUNDS = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))


def type_text(annotation: Any) -> str:
    """A type as a config author reads it: `int`, `float | null`, `dp | fsdp | ...`."""
    if annotation is type(None):
        return "null"
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return type_text(args[0])
    if origin in (typing.Union, types.UnionType):
        parts = [type_text(a) for a in args]
        if "null" in parts:   # null last
            parts = [p for p in parts if p != "null"] + ["null"]
        return " | ".join(parts)
    if origin is typing.Literal:
        return " | ".join(str(a) for a in args)
    if origin in (list, tuple, dict):
        inner = ", ".join("..." if a is Ellipsis else type_text(a) for a in args)
        return f"{origin.__name__}[{inner}]"
    if isinstance(annotation, type):
        if issubclass(annotation, Path):
            return "path"
        if issubclass(annotation, BaseModel):
            return "section"
        if issubclass(annotation, enum.Enum):
            return " | ".join(str(m.value) for m in annotation)
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def _bounds(info: FieldInfo) -> str:
    found = []
    for item in info.metadata:
        for attr, sign in _BOUNDS:
            value = getattr(item, attr, None)
            if value is not None:
                found.append(f"{sign} {value}")
    return ", ".join(found)


def _plain(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json", by_alias=True)
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def default_text(info: FieldInfo) -> str:
    """The default as YAML writes it: `null`, `true`, `8`, `dp`, `[0]`."""
    if info.default_factory is not None:
        value = info.default_factory()
    elif info.default is PydanticUndefined:
        return "(required)"
    else:
        value = info.default
    value = _plain(value)
    if isinstance(value, str):
        return value
    return json.dumps(value)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _section_type(info: FieldInfo) -> type[BaseModel] | None:
    """The section class a field holds (`data.window`: WindowConfig | None too)."""
    annotation = info.annotation
    candidates = typing.get_args(annotation) or (annotation,)
    for candidate in candidates:
        if isinstance(candidate, type) and issubclass(candidate, BaseModel) \
                and candidate is not BaseModel:
            return candidate
    return None


def _doc(cls: type) -> str:
    doc = (cls.__doc__ or "").strip()
    # the first line names the section ("train: ..."); the rest is what it does
    return " ".join(doc.split())


def section_lines(cls: type[BaseModel], prefix: str, title: str,
                  skip: tuple[str, ...] = ()) -> list[str]:
    """A section's heading, its docstring and a table of its keys; nested sections after."""
    lines = [f"{title} `{prefix.rstrip('.') or 'top level'}`", "", _doc(cls), "",
             "| key | type | default | description |", "|---|---|---|---|"]
    nested: list[tuple[type[BaseModel], str]] = []
    for name, info in cls.model_fields.items():
        key = info.alias or name
        if key in skip:
            continue
        sub = _section_type(info)
        typ = type_text(info.annotation)
        bounds = _bounds(info)
        if sub is not None:
            nested.append((sub, f"{prefix}{key}."))
            if info.default is not None and info.default is not PydanticUndefined:
                continue   # always present: its keys are listed below
            typ = typ.replace("section", f"section `{prefix}{key}`")
        description = info.description or ""
        lines.append(f"| `{prefix}{key}` | {_cell(typ)}{_cell(', ' + bounds) if bounds else ''}"
                     f" | `{_cell(default_text(info))}` | {_cell(description)} |")
    lines.append("")
    for sub, sub_prefix in nested:
        lines += section_lines(sub, sub_prefix, "###")
    return lines


def task_sections() -> list[tuple[str, str, type[BaseModel]]]:
    """(name, module:Class, model section) of each built-in task."""
    from spmd.tasks.registry import import_task

    return [(name, path, import_task(path).Config) for name, path in BUILTIN_TASKS.items()]


def render() -> str:
    """docs/config.md's text."""
    lines = [
        "# Configuration reference",
        "",
        f"<!-- GENERATED by `{COMMAND}` from the pydantic models: do not edit. -->",
        "",
        "Every key of a run's config, generated from the pydantic models that validate it. "
        "A config is YAML (`spmd train config.yaml`); any key can be set on the command line "
        "as a dotted override (`spmd train config.yaml train.steps=500 mesh.strategy=fsdp`), "
        "its value read as YAML. An unknown key is an error naming the closest known one; a "
        "bad value is an error naming the key and where it was set (the file, or the "
        "override as given on the command line).",
        "",
        "Each section is declared next to the component that builds from it "
        "(docs/architecture.md); to add a key, add a field with a `description` there and "
        f"run `{COMMAND}`.",
        "",
    ]
    top = [name for name, info in Config.model_fields.items() if _section_type(info) is None
           and name != "model"]
    lines += section_lines(Config, "", "##", skip=tuple(
        n for n in Config.model_fields if n not in top))
    for name, info in Config.model_fields.items():
        if name == "model":
            lines += model_lines()
            continue
        sub = _section_type(info)
        if sub is not None:
            lines += section_lines(sub, f"{name}.", "##")
    lines += ["## Deprecated keys", "",
              "Still read, for one release, with a warning naming the new key.", "",
              "| old key | new key |", "|---|---|"]
    lines += [f"| `train.{old}` | `{section}.{key}` |"
              for old, (section, key) in DEPRECATED_KEYS.items()]
    return "\n".join(lines).rstrip() + "\n"


def model_lines() -> list[str]:
    from spmd.tasks.base import ModelConfig

    lines = section_lines(ModelConfig, "model.", "##")
    lines[2] = ("The task's own section, validated by its class attribute `Config` (a subclass "
                "of `spmd.ModelConfig`); its keys are the task's. The built-in tasks' sections "
                "follow; a task of your own documents its own.")
    for name, path, section in task_sections():
        body = section_lines(section, "model.", "###", skip=())
        body[0] = f"### `model.name: {name}` ({path})"
        lines += body
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=DEFAULT_PATH,
                        help="where to write (default: the checkout's docs/config.md)")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if the file differs from the models")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = args.output.read_text() if args.output.is_file() else ""
        if current != text:
            print(f"{args.output} is stale: run `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    args.output.write_text(text)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
