"""One import root: everything is `spmd.*`, and a user's own folders never shadow it."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib

from tests.helpers.env import REPO, clean_env

TOP_LEVEL = ("sharding", "launch", "models", "jobscripts")
BARE = re.compile(rf"^\s*(?:import|from)\s+({'|'.join(TOP_LEVEL)})\b", re.M)
PROSE = re.compile(rf"\b(?:import|from)\s+({'|'.join(TOP_LEVEL)})\b")


def tracked(*patterns: str) -> list:
    out = subprocess.run(["git", "ls-files", *patterns], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout.split()
    return [REPO / p for p in out]


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
    code = ("import spmd.models.fno, spmd.launch, spmd.sharding, spmd.train.trainer, spmd.cli\n"
            "print(spmd.launch.__file__)")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                       text=True, env=clean_env(PYTHONPATH=str(tmp_path)), timeout=120)
    assert r.returncode == 0, r.stderr
    assert str(tmp_path) not in r.stdout


ALLOWED = {"launch": ("launch",), "sharding": ("sharding",), "models": ("models", "sharding")}
SPMD_IMPORT = re.compile(r"^\s*(?:from|import)\s+spmd\.(\w+)", re.M)


def test_imports_point_one_way():
    """launch and sharding import nothing else of spmd; models only sharding."""
    offenders = []
    for folder, allowed in ALLOWED.items():
        for path in tracked(f"{folder}/*.py"):
            for m in SPMD_IMPORT.finditer(path.read_text()):
                if m.group(1) not in allowed:
                    offenders.append(f"{path.relative_to(REPO)}: {m.group(0).strip()}")
    assert not offenders, offenders
