"""One import root, and the layers: everything is `spmd.*`, imports point down, no circles.

The layer table below is the architecture (docs/architecture.md draws it): a module may
import modules of its own layer and of the layers below, never above, not even inside a
function (only `if TYPE_CHECKING:` imports are exempt). Nothing of the checkout (spmd/'s
parent folder) leaks into the package, in an editable install or a regular one.
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from pydantic import BaseModel

from tests.helpers.env import REPO, clean_env
from tests.helpers.imports import cycles, import_edges, package_modules

TOP_LEVEL = ("sharding", "launch", "models", "jobscripts")
BARE = re.compile(rf"^\s*(?:import|from)\s+({'|'.join(TOP_LEVEL)})\b", re.M)
PROSE = re.compile(rf"\b(?:import|from)\s+({'|'.join(TOP_LEVEL)})\b")

# Bottom to top. The longest matching prefix names a module's layer.
LAYERS: list[tuple[str, ...]] = [
    ("spmd", "spmd.errors", "spmd.atomic_write"),  # the root (lazy names only), the exit
    #                                                table and the one atomic file write
    ("spmd.launch",),                          # scheduler + MPI bootstrap, signals; launch:
    ("spmd.comm",),                            # agreement and broadcast among ranks
    ("spmd.sharding",),                        # logical axes -> mesh axes
    ("spmd.optim",),                           # optimizer:, schedule: and their builders
    ("spmd.models",),                          # reference models
    ("spmd.scores",),                          # scores any task uses (lat-weighted RMSE)
    ("spmd.data",),                            # sources and the batch feed; data:
    ("spmd.tasks",),                           # model + loss + data, the user's plug-in point
    ("spmd.rundir",),                          # lease, metrics, plots; run:
    ("spmd.engine",),                          # mesh, state, steps, runtime; mesh:, train:
    ("spmd.checkpoint",),                      # both tiers; checkpoint:
    ("spmd.config",),                          # assembles the sections: Config, YAML, tasks
    ("spmd.hpc", "spmd.jobscripts"),           # system profiles, batch scripts
    ("spmd.loop",),                            # the training loop and its hooks
    ("spmd.inference",),                       # load, eval, predict, export a trained run
    ("spmd.aot",),                             # plan: compile ahead of time
    ("spmd.api",),                             # spmd.train(...)
    ("spmd.cli",),                             # the console script
]
# A layer's own errors module may share its name with another layer's.
SHARED_NAMES = {"__init__", "__main__", "errors"}


def tracked(*patterns: str) -> list:
    out = subprocess.run(["git", "ls-files", *patterns], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout.split()
    return [REPO / p for p in out]


def layer_of(module: str) -> int:
    best, length = None, -1
    for rank, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > length:
                best, length = rank, len(prefix)
    assert best is not None, f"{module} belongs to no layer: add it to LAYERS"
    return best


def layer_violations(edges: dict[str, dict[str, int]], modules: dict[str, Path]) -> list[str]:
    out = []
    for importer, targets in sorted(edges.items()):
        for target, line in targets.items():
            if layer_of(target) > layer_of(importer):
                where = modules[importer].relative_to(REPO)
                out.append(f"{where}:{line}: {importer} (layer {LAYERS[layer_of(importer)][0]})"
                           f" imports {target} (layer {LAYERS[layer_of(target)][0]}, above it)")
    return out


def test_no_code_or_doc_imports_a_bare_top_level_name():
    offenders = [f"{p.relative_to(REPO)}: {m.group(0).strip()}"
                 for p in tracked("*.py") for m in BARE.finditer(p.read_text())]
    offenders += [f"{p.relative_to(REPO)}: {m.group(0)}"
                  for p in tracked("*.md") for m in PROSE.finditer(p.read_text())]
    assert not offenders, offenders


def test_pyproject_installs_every_package_folder_under_spmd():
    setup = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {p.parent.relative_to(REPO).as_posix()
               for p in tracked("*/__init__.py", "*/*/__init__.py")
               if p.parent.relative_to(REPO).parts[0] in ("spmd", *TOP_LEVEL)}
    mapped = {pkg: dir_ for pkg, dir_ in setup["package-dir"].items()}
    expected = set()
    for folder in folders:
        top, *rest = folder.split("/")
        expected.add(".".join(["spmd", *([] if top == "spmd" else [top]), *rest]))
    assert set(setup["packages"]) == expected
    for name in TOP_LEVEL:
        assert mapped[f"spmd.{name}"] == name


def test_a_users_own_models_and_launch_do_not_shadow_spmd(tmp_path):
    for name in ("models", "launch", "sharding"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise ImportError('user {name}')\n")
    code = ("import spmd.models.fno, spmd.launch, spmd.sharding, spmd.loop.trainer, spmd.cli\n"
            "print(spmd.launch.__file__)")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                       text=True, env=clean_env(PYTHONPATH=str(tmp_path)), timeout=120)
    assert r.returncode == 0, r.stderr
    assert str(tmp_path) not in r.stdout


ALLOWED = {"launch": ("launch", "errors", "atomic_write"),
           "sharding": ("sharding", "errors", "atomic_write"),
           "models": ("models", "sharding")}
SPMD_IMPORT = re.compile(r"^\s*(?:from|import)\s+spmd\.(\w+)", re.M)


def test_imports_point_one_way():
    """launch and sharding import nothing else of spmd (but its exit table and its atomic
    write); models only sharding."""
    offenders = []
    for folder, allowed in ALLOWED.items():
        for path in tracked(f"{folder}/*.py"):
            for m in SPMD_IMPORT.finditer(path.read_text()):
                if m.group(1) not in allowed:
                    offenders.append(f"{path.relative_to(REPO)}: {m.group(0).strip()}")
    assert not offenders, offenders


def test_every_import_points_down_the_layers():
    modules = package_modules(REPO)
    violations = layer_violations(import_edges(modules), modules)
    assert not violations, "imports that point up the layers:\n" + "\n".join(violations)


def test_no_import_circle_between_modules():
    """Function-local imports count; only `if TYPE_CHECKING:` imports are exempt."""
    circles = cycles(import_edges(package_modules(REPO)))
    assert not circles, "modules that import each other, directly or not:\n" + "\n".join(
        " <-> ".join(circle) for circle in circles)


# spmd.data's rooms, bottom to top (spmd/data/__init__.py): each imports only its own modules,
# those of the rooms below it and the package's own floor (batch, data_config, order, ...).
DATA_ROOMS = ["formats", "cf", "stats", "reads", "sources", "loader"]


def test_the_rooms_of_spmd_data_import_only_the_rooms_below():
    edges = import_edges(package_modules(REPO))

    def room(module: str) -> int | None:
        parts = module.split(".")
        if parts[:2] != ["spmd", "data"] or len(parts) < 3:
            return None
        return DATA_ROOMS.index(parts[2]) if parts[2] in DATA_ROOMS else -1   # -1: the floor

    assert {m.split(".")[2] for m in edges if room(m) is not None and room(m) >= 0} == set(
        DATA_ROOMS), "a room of spmd.data is missing from DATA_ROOMS, or has no module"
    upward = [f"{importer} imports {target}" for importer, targets in edges.items()
              if room(importer) is not None for target in targets
              if room(target) is not None and room(target) > room(importer)]
    assert not upward, "spmd.data's rooms import upward:\n" + "\n".join(upward)


WHOLE_CONFIG = re.compile(r"\bConfig\b")


def test_no_layer_below_the_tasks_takes_the_whole_config():
    """The run's `Config` stops at spmd.tasks (`Task.cfg`, user API): below it, a data
    source takes `SourceSections` (`Config.source_sections()`), as the engine takes
    `EngineSections`. No function of a lower layer has a parameter typed `Config`, nor a
    `cfg` that is `Any` or untyped and so may stand for one."""
    below = layer_of("spmd.tasks")
    offenders = []
    for module, path in package_modules(REPO).items():
        if layer_of(module) >= below:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            a = node.args
            for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs]:
                note = ast.unparse(arg.annotation) if arg.annotation is not None else ""
                if WHOLE_CONFIG.search(note) or (arg.arg == "cfg" and note in ("", "Any")):
                    offenders.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.name}"
                                     f"({arg.arg}: {note or 'untyped'})")
    assert not offenders, ("below spmd.tasks, take the sections you read, not the whole "
                           "Config:\n" + "\n".join(offenders))


def package_of(module: str) -> str:
    """The package a module belongs to: `spmd.config.load` -> `spmd.config`; the root's own
    modules (`spmd.errors`, `spmd.api`) are each their own."""
    return ".".join(module.split(".")[:2])


def package_edges(edges: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """The module graph collapsed onto packages (imports within a package dropped)."""
    out: dict[str, dict[str, int]] = {}
    for importer, targets in edges.items():
        node = out.setdefault(package_of(importer), {})
        for target, line in targets.items():
            if package_of(target) != package_of(importer):
                node.setdefault(package_of(target), line)
    return out


def test_no_import_circle_between_packages():
    """No two packages import each other, directly or not (as `spmd.config` and `spmd.tasks`
    once did: the schema below the tasks, loading above them)."""
    circles = cycles(package_edges(import_edges(package_modules(REPO))))
    assert not circles, "packages that import each other, directly or not:\n" + "\n".join(
        " <-> ".join(circle) for circle in circles)


def test_the_config_package_sits_above_the_sections_it_assembles():
    """Every section of `Config` lives in a package below `spmd.config` (next to the
    component that builds from it), and `spmd.config` defines none of its own."""
    from spmd.config.schema import Config

    def sections(cls) -> list[type]:
        out = []
        for field in cls.model_fields.values():
            annotation = field.annotation
            if isinstance(field.default, BaseModel):   # `model:` is typed as any model
                annotation = type(field.default)
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                out += [annotation, *sections(annotation)]
        return out

    found = sections(Config)
    assert len(found) >= 9, found
    for section in found:
        home = section.__module__
        assert not home.startswith("spmd.config"), f"{section.__name__} is defined in {home}"
        assert layer_of(home) < layer_of("spmd.config"), (section.__name__, home)


def test_the_checks_catch_a_violating_import(tmp_path):
    """The two checks above fail on an upward import and on a circle (they are not vacuous)."""
    modules = package_modules(REPO)
    edges = import_edges(modules)
    edges["spmd.launch.env"] = {**edges["spmd.launch.env"], "spmd.loop.trainer": 1}
    assert any("spmd.launch.env (layer spmd.launch) imports spmd.loop.trainer" in v
               for v in layer_violations(edges, modules))
    edges["spmd.sharding.rules"] = {**edges["spmd.sharding.rules"], "spmd.sharding.report": 1}
    assert any("spmd.sharding.rules" in c and "spmd.sharding.report" in c
               for c in cycles(edges))
    edges = import_edges(modules)   # a circle within one package is no package's circle
    edges["spmd.sharding.rules"] = {**edges["spmd.sharding.rules"], "spmd.sharding.report": 1}
    assert not cycles(package_edges(edges))
    edges["spmd.tasks.base"] = {**edges["spmd.tasks.base"], "spmd.config.schema": 1}
    assert any({"spmd.config", "spmd.tasks"} <= set(c) for c in cycles(package_edges(edges)))


def test_module_names_are_unique_and_shadow_no_standard_module():
    names: dict[str, list[str]] = {}
    for module in package_modules(REPO):
        if module != "spmd":
            names.setdefault(module.rsplit(".", 1)[-1], []).append(module)
    clashes = {k: v for k, v in names.items() if len(v) > 1 and k not in SHARED_NAMES}
    assert not clashes, clashes
    stdlib = sorted(n for n in names if n in sys.stdlib_module_names)
    assert not stdlib, f"modules named like the standard library's: {stdlib}"


def test_spmd_keeps_few_top_level_modules_and_each_layer_says_what_it_owns():
    top = sorted(p.name for p in (REPO / "spmd").glob("*.py"))
    assert len(top) <= 4, top
    for init in sorted([*(REPO / "spmd").glob("*/__init__.py"),
                        *(REPO / f / "__init__.py" for f in TOP_LEVEL)]):
        doc = (init.read_text().split('"""') + ["", ""])[1]
        assert len(doc) > 40 and "import" in doc, (
            f"{init.relative_to(REPO)}: its docstring must say what the layer owns and what it "
            "may import")


def test_no_subpackage_hides_a_public_name_of_spmd():
    """`spmd.train(...)` is a function: a subpackage `spmd/train/` would replace it on the
    `spmd` module the moment anything imported it."""
    import spmd

    children = {p.stem for p in (REPO / "spmd").iterdir()
                if p.suffix == ".py" or (p / "__init__.py").is_file()}
    assert not children & set(spmd.__all__), children & set(spmd.__all__)
    code = ("import spmd, spmd.loop.trainer, spmd.cli, spmd.aot.plan\n"
            "assert callable(spmd.train), spmd.train\n"
            "assert spmd.Stop is spmd.loop.hooks.Stop")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=clean_env(), timeout=120)
    assert r.returncode == 0, r.stderr


LEAK_CHECK = """
import importlib, sys
import spmd, spmd.cli, spmd.launch, spmd.sharding, spmd.models.fno, spmd.loop.trainer
from spmd import jobscripts
from importlib import resources
assert resources.files(jobscripts).joinpath("slurm.sh.j2").is_file()
leaked = []
for name in ("spmd.spmd", "spmd.tests", "spmd.examples", "spmd.benchmarks", "spmd.configs"):
    try:
        importlib.import_module(name)
        leaked.append(name)
    except ModuleNotFoundError:
        pass
print(spmd.__file__)
print(spmd.launch.__file__)
print("LEAKED", *leaked)
"""


def _check_no_leak(env: dict[str, str], cwd: Path) -> list[str]:
    r = subprocess.run([sys.executable, "-c", LEAK_CHECK], cwd=cwd, capture_output=True,
                       text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[-1] == "LEAKED", lines[-1]
    return lines[:-1]


def test_nothing_of_the_checkout_leaks_into_the_editable_install(tmp_path):
    spmd_file, launch_file = _check_no_leak(clean_env(), tmp_path)
    assert Path(spmd_file).parent == REPO / "spmd"
    assert Path(launch_file).parent == REPO / "launch"


@pytest.mark.slow
def test_a_regular_install_passes_the_import_root_checks(tmp_path):
    """`pip install .` (not editable): the one import root, no leak, templates included."""
    source, target = tmp_path / "source", tmp_path / "site"
    # A copy of the working tree as git sees it: a build in the checkout would leave a build/
    # folder whose stale modules the next wheel would carry.
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.split()
    for name in files:
        if (REPO / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                        "--target", str(target), str(source)], capture_output=True, text=True,
                       timeout=600, env=clean_env())
    assert r.returncode == 0, r.stdout + r.stderr
    for name in ("models", "launch", "sharding"):  # a user's own folders shadow nothing
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise ImportError('user {name}')\n")
    env = clean_env(PYTHONPATH=f"{target}:{tmp_path}")
    spmd_file, launch_file = _check_no_leak(env, tmp_path)
    assert Path(spmd_file).is_relative_to(target), spmd_file
    assert Path(launch_file) == target / "spmd" / "launch" / "__init__.py"
