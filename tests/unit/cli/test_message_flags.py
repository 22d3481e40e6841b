"""Every `--flag` and every config key that the package's messages name exists.

A message that says "use --dataset.a" or "set train.batchsize" sends the user to a flag or a
key that `spmd` refuses. This test reads the package source (spmd/, launch/, sharding/,
models/, jobscripts/), takes the messages out of it and checks what they name:

- Messages are the string literals and f-strings (their literal parts; a `{value}` part
  stays a placeholder) inside a `raise`, a call of print / a logger method / warn / exit /
  a parser's error / an exception class, an argparse `help=`, `description=`, `epilog=` or
  `usage=`, and the docstrings of spmd/cli (they are the commands' help). In the job script
  templates, the comment lines and the `spmd_log` lines (not the scheduler directives).
- A flag belongs to the nearest tool named before it in its stretch of the message (a
  stretch ends at a backtick, `;`, `. ` or a line end): `spmd <command> [<subcommand>]` is
  checked against that command's real argparse parser (spmd.cli.main.build_parser, read
  when the test runs, so a flag added today counts); another tool's flag must be in
  OTHER_TOOLS; a flag with no tool is checked against the command of the spmd/cli/<name>_cmd
  module it is in (the templates: `spmd jobscript`, or their scheduler's own flags), else
  against every spmd command.
- A dotted key `section.key` of the sections run, mesh, train, data, checkpoint, launch,
  optimizer, schedule and model is checked against the live schema (`spmd.config.Config`,
  its pydantic fields walked down, aliases included, and the built-in tasks' `model:`
  sections). File names (`data.h5`), code (`cfg.train.steps`, `model.apply(`) and keys
  under a free-form mapping (`data.fields.u`) are not keys to check.

The collected flags are also checked to be there at all (a scanner that finds nothing
passes everything), and each OTHER_TOOLS entry to still occur in a message (no stale
entries).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import re
import tomllib
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pydantic
import pytest

from tests.helpers.env import REPO

ROOTS = ("spmd", "launch", "sharding", "models", "jobscripts")

# Flags of other tools that messages name on purpose, by tool. Keep it small: each entry must
# still occur in a message (test_every_allowed_flag_still_occurs).
OTHER_TOOLS: dict[str, set[str]] = {
    "mpiexec": {"--version",           # run_cmd: which MPI is this (`mpiexec --version`)
                "--hosts"},            # pbs.sh.j2: a relaunch without the failed host
    "srun": {"--gpus-per-task", "--mpi",  # launch/: how to bind GPUs and give ranks PMI
             "--exclude",              # slurm.sh.j2: a relaunch without the failed node
             "--ntasks-per-node"},     # ckpt_cmd: `spmd ckpt ls` once on every node
    "flux": {"--parent", "--signal",   # flux.sh.j2: the chained submission and its signal
             "--requires"},            # flux.sh.j2: a relaunch without the failed host
    "sbatch": {"--signal",             # slurm.sh.j2: how the warning signal is asked for
               "--no-kill"},           # slurm.sh.j2: the allocation outlives a failed node
    "scancel": {"--signal", "--batch"},  # slurm.sh.j2: sending that signal by hand
}
# Names that start another tool's command line in a message (besides OTHER_TOOLS' keys): a
# flag after one of them that is not in OTHER_TOOLS fails, naming the tool to add.
TOOLS = {"srun", "salloc", "sbatch", "scancel", "scontrol", "mpiexec", "mpirun", "jsrun",
         "aprun", "flux", "bsub", "qsub", "pip", "python", "python3", "git", "mlflow",
         "tensorboard", "wandb", "nvidia-smi", "rocm-smi", "ssh"}
TEMPLATE_TOOL = {"slurm": "sbatch", "flux": "flux", "lsf": "bsub", "pbs": "qsub"}

MESSAGE_CALLS = {"print", "warn", "exit", "error", "warning", "info", "debug", "exception",
                 "critical", "log"}
MESSAGE_KEYWORDS = {"help", "description", "epilog", "usage"}
# A variable or keyword of this name holds (part of) a message, or the key or flag a message
# names (`hint = "..."`, `config_key="--input"`).
MESSAGE_NAME = re.compile(r"hint|msg|message|advice|why|reason|problem|detail|(?:^|_)key$", re.I)

# `--name`, `--name-with-dashes`, and what follows a dot, a placeholder too (`--dataset.{name}`
# is no flag either).
FLAG = re.compile(r"(?<![\w\-{}])--([a-z][a-z0-9]*(?:[-_][a-z0-9]+)*"
                  r"(?:\.(?:[a-z0-9_]+|\{[^{}]*\}))*)(?![\w-])")
TOOL = re.compile(r"(?<![\w.\-/])(?:spmd((?:\s+[a-z]+){0,2})|\{?([a-z][\w\-]*)\}?)(?![\w\-.])"
                  r"|--entry[\s=]([a-z]+)")   # `spmd run ... --entry predict PATH -- --input`
STRETCH = re.compile(r"`|;|\.\s|\n")

SECTIONS = ("run", "mesh", "train", "data", "checkpoint", "launch", "optimizer", "schedule",
            "model")
KEY = re.compile(rf"(?<![\w.\-/$@{{])((?:{'|'.join(SECTIONS)})(?:\.[a-z_][a-z0-9_]*)+)"
                 r"(?![\w\-({]|\.[a-z_0-9])")
FILE_SUFFIXES = {"py", "h5", "hdf5", "nc", "zarr", "npy", "npz", "yaml", "yml", "json",
                 "jsonl", "txt", "log", "md", "csv", "sh", "j2", "out", "err", "pkl", "bin"}


@dataclass(frozen=True)
class Message:
    text: str
    where: str          # file:line
    command: str        # the spmd command a flag without a tool belongs to ("": any)
    tool: str | None = None  # a template's scheduler tool, for its own flags


# -- the messages ------------------------------------------------------------------------


def _text(node: ast.AST) -> str | None:
    """A string literal's text, or an f-string's with `{expr}` for each value."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        parts = []
        for value in node.values:
            if isinstance(value, ast.Constant):
                parts.append(str(value.value))
            else:
                parts.append("{" + ast.unparse(value.value) + "}")  # type: ignore
        return "".join(parts)
    return None


def _strings(node: ast.AST) -> Iterator[tuple[str, int, int]]:
    """(text, line, node id) of the strings anywhere under `node` (an f-string whole, not
    its parts)."""
    stack = [node]
    while stack:
        here = stack.pop()
        text = _text(here)
        if text is not None:
            yield text, here.lineno, id(here)
            continue
        stack.extend(ast.iter_child_nodes(here))


def _call_name(call: ast.Call) -> str:
    func = call.func
    return func.id if isinstance(func, ast.Name) else (
        func.attr if isinstance(func, ast.Attribute) else "")


def _python_messages(path: Path, rel: Path) -> list[tuple[str, int]]:
    """The messages of one module, each string once (`raise E("...")` is a raise and a call)."""
    tree = ast.parse(path.read_text(), str(rel))
    found = dict.fromkeys(_message_strings(tree, rel.parts[:2] == ("spmd", "cli")))
    return [(text, line) for text, line, _ in found]


def _message_strings(tree: ast.Module, cli: bool) -> Iterator[tuple[str, int, int]]:
    """(text, line, id of the node) of each message string, a string maybe more than once."""
    if cli and ast.get_docstring(tree, clean=False):
        yield ast.get_docstring(tree, clean=False) or "", 1, id(tree.body[0])
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and node.exc is not None:
            yield from _strings(node.exc)
        elif isinstance(node, ast.Call):
            name = _call_name(node)
            if name in MESSAGE_CALLS or name.endswith(("Error", "Exception", "Warning", "Exit")):
                for arg in [*node.args, *(k.value for k in node.keywords)]:
                    yield from _strings(arg)
            else:
                for k in node.keywords:
                    if k.arg in MESSAGE_KEYWORDS or MESSAGE_NAME.search(k.arg or ""):
                        yield from _strings(k.value)
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign) and node.value:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [t.id if isinstance(t, ast.Name) else getattr(t, "attr", "")
                     for t in targets]
            if any(MESSAGE_NAME.search(name) for name in names):
                yield from _strings(node.value)
        elif isinstance(node, ast.arguments):
            # a parameter's default that is a key or a flag (`fields_key: str = "data.fields"`)
            params = [*node.posonlyargs, *node.args, *node.kwonlyargs]
            defaults = [*[None] * (len(node.posonlyargs) + len(node.args) - len(node.defaults)),
                        *node.defaults, *node.kw_defaults]
            for param, default in zip(params, defaults):
                if default is not None and MESSAGE_NAME.search(param.arg):
                    yield from _strings(default)


def _template_messages(path: Path) -> Iterator[tuple[str, int]]:
    for i, line in enumerate(path.read_text().splitlines(), 1):
        stripped = line.strip()
        directive = re.match(r"#\s*(SBATCH|BSUB|PBS|flux:)|#!", stripped)
        if stripped.startswith("#") and not directive:
            yield stripped, i
        elif "spmd_log" in stripped:
            yield stripped[stripped.index("spmd_log"):], i


def messages() -> list[Message]:
    found = []
    for root in ROOTS:
        for path in sorted((REPO / root).rglob("*")):
            rel = path.relative_to(REPO)
            if path.suffix == ".py":
                command = (path.stem.removesuffix("_cmd")
                           if rel.parts[:2] == ("spmd", "cli") and path.stem.endswith("_cmd")
                           else "")
                found += [Message(t, f"{rel}:{n}", command) for t, n in _python_messages(path, rel)]
            elif path.name.endswith(".j2"):
                tool = TEMPLATE_TOOL.get(path.name.split(".")[0])
                found += [Message(t, f"{rel}:{n}", "jobscript", tool)
                          for t, n in _template_messages(path)]
    return found


# -- the flags they name -----------------------------------------------------------------


def _owner(stretch: str, end: int) -> str | None:
    """The last tool named in `stretch` before `end`: "spmd <words>" or another tool's name."""
    owner = None
    for m in TOOL.finditer(stretch, 0, end):
        if m.group(3):
            owner = f"spmd {m.group(3)}"
        elif m.group(0).startswith("spmd") and m.group(2) is None:
            owner = " ".join(["spmd", *m.group(1).split()])
        elif m.group(2) in TOOLS or m.group(2) in OTHER_TOOLS:
            owner = m.group(2)
    return owner


def named_flags(message: Message) -> Iterator[tuple[str | None, str]]:
    """(owner, flag) for each flag the message names; owner None: no tool before it."""
    for stretch in STRETCH.split(message.text):
        for m in FLAG.finditer(stretch):
            yield _owner(stretch, m.start()), "--" + m.group(1)


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for action in parser._actions for s in action.option_strings}


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return {name: sub for action in parser._actions
            if isinstance(action, argparse._SubParsersAction)
            for name, sub in action.choices.items()}


@pytest.fixture(scope="module")
def spmd_flags() -> dict[str, set[str]]:
    """Option strings by command path ("", "train", "data make", ...); a command's set holds
    its subcommands' options too, and the top-level options (`spmd --debug train`)."""
    from spmd.cli.main import build_parser

    top = build_parser()
    flags: dict[str, set[str]] = {"": set(_options(top))}
    for name, sub in _subparsers(top).items():
        flags[name] = _options(sub) | flags[""]
        for child, parser in _subparsers(sub).items():
            flags[f"{name} {child}"] = _options(parser) | flags[""]
            flags[name] |= _options(parser)
    flags["*"] = set().union(*flags.values())
    return flags


def check_flag(flags: dict[str, set[str]], message: Message, owner: str | None,
               flag: str) -> str | None:
    """What is wrong with `flag` as `message` names it, or None."""
    if owner is None and message.tool and flag in OTHER_TOOLS.get(message.tool, ()):
        return None     # a template's comment about its scheduler's own directive
    if owner is not None and not owner.startswith("spmd"):
        if flag in OTHER_TOOLS.get(owner, ()):
            return None
        return (f"{flag} of `{owner}`: not in OTHER_TOOLS; add it there, with why a message "
                f"names it")
    if owner is None:
        command = message.command or "*"
    else:
        words = owner.split()[1:]
        while words and " ".join(words) not in flags:
            words.pop()  # `spmd run -n 2 CONFIG`: the words after the command are arguments
        command = " ".join(words)
    if command not in flags:
        return f"{flag}: no spmd command '{command}'"
    if flag not in flags[command]:
        if command == "*":
            return f"{flag} is not a flag of any spmd command"
        return f"{flag} is not a flag of spmd {command} (it has {sorted(flags[command])})"
    return None


# -- the config keys they name -----------------------------------------------------------


def _models(annotation: object) -> Iterator[type[pydantic.BaseModel]]:
    """The pydantic models an annotation can hold (through Optional, unions, Annotated)."""
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        yield annotation
        return
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType, typing.Annotated) or (
            origin is not None and getattr(origin, "__name__", "") == "SerializeAsAny"):
        for arg in typing.get_args(annotation):
            yield from _models(arg)


def _free(annotation: object) -> bool:
    """Whether a field holds a free-form mapping (keys below it are the user's names)."""
    origin = typing.get_origin(annotation)
    if origin in (dict, typing.Union, types.UnionType, typing.Annotated):
        return origin is dict or any(_free(a) for a in typing.get_args(annotation))
    return annotation is typing.Any or annotation is dict


def _fields(model: type[pydantic.BaseModel]) -> dict[str, object]:
    fields: dict[str, object] = {}
    for name, info in model.model_fields.items():
        fields[name] = info.annotation
        if info.alias:
            fields[info.alias] = info.annotation
    return fields


def _optional_model_keys() -> dict[str, object]:
    """The `model:` keys that the built-in task classes read if a task's Config has them
    (`getattr(self.model_cfg, "files", 1)` in spmd.tasks.trajectory_task)."""
    keys: dict[str, object] = {}
    for path in (REPO / "spmd" / "tasks").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and _call_name(node) == "getattr"
                    and len(node.args) >= 2 and "model_cfg" in ast.unparse(node.args[0])
                    and isinstance(node.args[1], ast.Constant)):
                keys[str(node.args[1].value)] = typing.Any
    return keys


Schema = dict[str, list[dict[str, object]]]


@pytest.fixture(scope="module")
def schema() -> Schema:
    """The keys of each top-level section (key -> annotation; one map per model that may hold
    the section): the live Config's, and for `model` also each built-in task's own `Config`
    (the tasks of pyproject.toml's spmd.tasks entry points) and the optional model keys."""
    from spmd.config import Config

    sections = {name: [_fields(m) for m in _models(annotation)]
                for name, annotation in _fields(Config).items()}
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    for target in project["project"]["entry-points"]["spmd.tasks"].values():
        module, _, name = target.partition(":")
        sections["model"].append(_fields(getattr(importlib.import_module(module), name).Config))
    sections["model"].append(_optional_model_keys())
    return sections


def check_key(schema: Schema, key: str) -> str | None:
    """What is wrong with the config key `key` (section.key[.key...]), or None."""
    section, *rest = key.split(".")
    if rest[-1] in FILE_SUFFIXES:
        return None     # a file name: data.h5, train.py
    if section not in schema:
        return f"{key}: the config has no section '{section}'"
    maps, path = schema[section], section
    for part in rest:
        if not maps:
            return None     # below a field that is not a section (a value)
        annotations = [fields[part] for fields in maps if part in fields]
        if not annotations:
            known = sorted({name for fields in maps for name in fields})
            return f"{key}: {path} has no key '{part}' (it has {known})"
        if any(_free(a) for a in annotations):
            return None     # below a mapping of the user's names: data.fields.u
        maps = [_fields(m) for a in annotations for m in _models(a)]
        path = f"{path}.{part}"
    return None


def named_keys(message: Message) -> Iterator[str]:
    for m in KEY.finditer(message.text):
        yield m.group(1)


# -- the tests ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def found() -> list[Message]:
    return messages()


def test_the_scan_finds_the_messages_it_should(found, spmd_flags):
    """The scanner sees messages everywhere, with their flags and keys, and resolves owners
    as intended (else the tests below would pass on nothing)."""
    assert len(found) > 300
    flags = {(owner, flag) for m in found for owner, flag in named_flags(m)}
    assert {("spmd plan", "--devices"), ("spmd run", "--ppn"), ("mpiexec", "--version"),
            (None, "--dataset")} <= flags
    keys = {k for m in found for k in named_keys(m)}
    assert {"train.batch_size", "data.path"} <= keys
    where = {m.where.split(":")[0] for m in found}
    assert {"spmd/cli/jobscript_cmd.py", "launch/mpi.py", "jobscripts/slurm.sh.j2"} <= where


def test_every_flag_a_message_names_exists(found, spmd_flags):
    wrong = [f"{m.where}: {problem}" for m in found for owner, flag in named_flags(m)
             if (problem := check_flag(spmd_flags, m, owner, flag))]
    assert not wrong, "messages name flags that do not exist:\n" + "\n".join(wrong)


def test_every_config_key_a_message_names_exists(found, schema):
    wrong = [f"{m.where}: {problem}" for m in found for key in named_keys(m)
             if (problem := check_key(schema, key))]
    assert not wrong, "messages name config keys that do not exist:\n" + "\n".join(wrong)


def test_every_allowed_flag_still_occurs(found):
    """An OTHER_TOOLS entry that no message names any more is stale: remove it."""
    named = {(owner or m.tool, flag) for m in found for owner, flag in named_flags(m)}
    stale = sorted(f"{tool} {flag}" for tool, allowed in OTHER_TOOLS.items()
                   for flag in allowed if (tool, flag) not in named)
    assert not stale, f"OTHER_TOOLS entries no message names: {stale}"


@pytest.mark.parametrize("text, problem", [
    ("dataset '{d}' has the wrong grid: use --dataset.a", "--dataset.a is not a flag"),
    ("run `spmd predict RUN --input F --datasets x`", "--datasets is not a flag of spmd predict"),
    ("`spmd plan CONFIG --nodes 8`", "--nodes is not a flag of spmd plan"),
    ("launch with `srun --exclusive`", "--exclusive of `srun`: not in OTHER_TOOLS"),
    ("`pip install --no-deps spmd-hpc`", "--no-deps of `pip`: not in OTHER_TOOLS"),
    ("set train.batchsize=8", "train has no key 'batchsize'"),
    ("raise launch.prepare_timeout", "launch has no key 'prepare_timeout'"),
])
def test_a_wrong_flag_or_key_is_caught(spmd_flags, schema, text, problem):
    message = Message(text, "here:1", "")
    problems = [check_flag(spmd_flags, message, owner, flag)
                for owner, flag in named_flags(message)]
    problems += [check_key(schema, key) for key in named_keys(message)]
    assert any(p and problem in p for p in problems), problems


@pytest.mark.parametrize("text", [
    "see `spmd predict RUN --input F --dataset x`; then `mpiexec --version`",
    "spmd run -n 2 configs/fno_darcy.yaml --entry m:f",
    "spmd data make CONFIG --force",
    "spmd --debug train CONFIG; spmd run --ppn 2 -n 4 C --entry predict RUN -- --rollout 2",
    "written to data.h5 and config.yaml; cfg.train.steps and model.apply(x) are code",
    "set data.fields.u, mesh.rules.batch, train.batch_size=16 or model.d_model",
])
def test_right_flags_and_keys_pass(spmd_flags, schema, text):
    message = Message(text, "here:1", "")
    assert [check_flag(spmd_flags, message, o, f) for o, f in named_flags(message)] == [
        None] * len(list(named_flags(message)))
    assert all(check_key(schema, key) is None for key in named_keys(message))


def test_predict_names_its_dataset_flag_for_a_file_of_the_wrong_grid(tmp_path):
    """`spmd predict` with an input of the wrong grid names --dataset, a real flag (it used
    to say --dataset.<field>)."""
    import h5py
    import numpy as np

    from spmd.data.sources.arrays import ArrayDataError, ArraySource
    from spmd.tasks import BatchField

    path = tmp_path / "wrong.h5"
    with h5py.File(path, "w") as f:
        f["test/a"] = np.zeros((4, 32, 32, 1), np.float32)
    field = BatchField((64, 64, 1), np.dtype("float32"), ("batch", None, None, None))
    source = ArraySource(path, {"a": "test/a"}, {"a": field}, 2, shuffle=False,
                         config_key="--input", fields_key="--dataset")
    with pytest.raises(ArrayDataError) as e:
        source.check()
    assert "point --dataset at another dataset" in str(e.value)
    assert "--dataset." not in str(e.value)
    message = Message(str(e.value), "here:1", "predict")
    assert all(check_flag({"predict": {"--dataset", "--input"}}, message, o, f) is None
               for o, f in named_flags(message))


def test_a_wrong_flag_or_key_in_a_module_fails_the_scan(tmp_path, spmd_flags, schema):
    """What a contributor might write: the scan takes the messages out of the code and the
    checks name each wrong flag and key; the right ones beside them pass."""
    module = tmp_path / "mine.py"
    module.write_text(
        "import logging\n"
        "log = logging.getLogger(__name__)\n"
        "def f(name, d):\n"
        "    hint = 'or run `spmd plan CONFIG --nodes 2`'\n"
        "    log.warning('set train.batchsize (not train.batch_size)')\n"
        "    raise ValueError(f'{d}: wrong grid; use --dataset.{name} or --dataset.a '\n"
        "                     'with --input, ' + hint)\n")
    found = [Message(text, f"mine.py:{n}", "") for text, n in
             _python_messages(module, Path("mine.py"))]
    flags = [check_flag(spmd_flags, m, o, f) for m in found for o, f in named_flags(m)]
    keys = [check_key(schema, k) for m in found for k in named_keys(m)]
    assert sorted(p.split(" ")[0] for p in flags if p) == [
        "--dataset.a", "--dataset.{name}", "--nodes"]
    assert [p.split(":")[0] for p in keys if p] == ["train.batchsize"]
    assert len(flags) == 4 and len(keys) == 2
