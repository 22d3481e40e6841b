"""spmd.launch.jax_stack: the installed JAX stack as `spmd doctor` reports it, the releases
known to be bad (left out by the pins, warned about when met anyway), and the extras that
pair a GPU plugin with jax."""

from __future__ import annotations

import json
import sys
import tomllib
from importlib import metadata

import jax
from packaging.requirements import Requirement

from spmd.launch import jax_stack
from tests.helpers.env import REPO, clean_env, run_spmd

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def requirement(name: str, among: list[str]) -> Requirement:
    found = [Requirement(r) for r in among if Requirement(r).name == name]
    assert len(found) == 1, (name, among)
    return found[0]


def test_the_installed_stack_is_what_python_imports():
    stack = jax_stack.installed()
    assert stack.versions["jax"] == jax.__version__
    assert stack.versions["jaxlib"] == metadata.version("jaxlib")
    assert stack.versions["flax"] == metadata.version("flax")
    assert stack.python == ".".join(map(str, sys.version_info[:3]))
    assert stack.to_dict()["versions"]["jax"] == jax.__version__
    # the CPU test machines have no PJRT plugin; a GPU node's would be listed here
    assert all(name.startswith(jax_stack.PLUGIN_PREFIXES) for name in stack.plugins)


def test_a_known_bad_release_is_named_with_what_goes_wrong():
    bad = jax_stack.known_bad({"jax": "0.11.2", "jaxlib": "0.11.2"})
    assert len(bad) == 1 and "stops donating" in bad[0] and "0.12" in bad[0]
    assert jax_stack.known_bad({"jax": "0.11.1", "jaxlib": "0.11.1"}) == []
    assert jax_stack.known_bad({"jaxlib": "0.12.0.1"}) == []
    assert jax_stack.known_bad() == jax_stack.known_bad(jax_stack.installed().versions)


def test_the_pins_leave_out_every_known_bad_release_and_admit_the_newest():
    deps = PYPROJECT["project"]["dependencies"]
    for (name, version) in jax_stack.KNOWN_BAD:
        assert not requirement(name, deps).specifier.contains(version), (name, version)
    for name in ("jax", "jaxlib"):
        spec = requirement(name, deps).specifier
        assert spec.contains("0.10.2") and spec.contains("0.12.0.1") and \
            spec.contains("0.11.1"), spec


def test_every_gpu_family_has_an_extra_that_pairs_its_plugin_with_jax():
    extras = PYPROJECT["project"]["optional-dependencies"]
    for extra, jax_extra in (("cuda12", "cuda12"), ("cuda13", "cuda13"), ("gpu", "cuda12"),
                             ("rocm", "rocm7-local")):
        req = requirement("jax", extras[extra])
        assert req.extras == {jax_extra}, (extra, req)
        for bad in jax_stack.KNOWN_BAD:
            assert not req.specifier.contains(bad[1]), (extra, req)
    # ROCm's plugin exists only for exact jax releases, and not for 0.12.0.1: one release
    rocm = requirement("jax", extras["rocm"]).specifier
    assert [s.operator for s in rocm] == ["=="] and not rocm.contains("0.12.0.1")


def test_a_plugin_built_for_another_jaxlib_is_a_warning(monkeypatch):
    monkeypatch.setattr(jax_stack, "_plugins", lambda: {"jax-cuda13-plugin": "0.11.2",
                                                        "jax-cuda13-pjrt": "0.12.0"})
    versions = dict(jax_stack.installed().versions)
    monkeypatch.setattr(jax_stack, "_version",
                        lambda name: "0.12.0.1" if name == "jaxlib" else versions.get(name))
    warnings = jax_stack.installed().warnings
    assert len(warnings) == 1, warnings                    # 0.12.0 pjrt fits jaxlib 0.12.0.1
    assert warnings[0].startswith("jax-cuda13-plugin 0.11.2 is built for jaxlib 0.11.2")
    assert "pip install 'jax[cuda13]==0.12.0.1'" in warnings[0]


def test_spmd_doctor_reports_the_stack_and_the_backend():
    out = run_spmd("doctor", "--json", env=clean_env(), timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert report["stack"]["versions"]["jax"] == jax.__version__
    assert report["stack"]["versions"]["orbax-checkpoint"] == \
        metadata.version("orbax-checkpoint")
    assert report["jax"]["platform"] == "cpu" and report["jax"]["device_kind"] == "cpu"
    assert report["warnings"] == jax_stack.known_bad()
    human = run_spmd("doctor", env=clean_env(), timeout=120)
    assert human.returncode == 0, human.stderr[-3000:]
    assert f"jax {jax.__version__}, jaxlib {metadata.version('jaxlib')}" in human.stdout
    assert "plugin         none" in human.stdout and "backend        cpu" in human.stdout


def test_the_gpu_wheels_carry_the_newest_stacks_versions():
    """benchmarks/gpu_wheels.sh carries, for the GPU image, the versions CI tests on the newest
    stack (constraints/py313.txt), one version of each."""
    import re

    from packaging.utils import canonicalize_name

    script = (REPO / "benchmarks" / "gpu_wheels.sh").read_text()
    wheels = re.search(r"^WHEELS=\((.*?)^\)", script, re.S | re.M).group(1).split()
    pinned = dict(w.split("==") for w in wheels)
    newest = dict(line.split("==") for line in
                  (REPO / "constraints" / "py313.txt").read_text().splitlines()
                  if line and not line.startswith("#"))
    newest = {canonicalize_name(k): v for k, v in newest.items()}
    assert len(pinned) == len(wheels) >= 16
    for name, version in pinned.items():
        assert newest.get(canonicalize_name(name)) == version, (name, version)
