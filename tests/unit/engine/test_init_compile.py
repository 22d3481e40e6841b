"""The initializer compiles at LLVM's optimisation level 1 (spmd.engine.state.run_once_options)
and still gives the bits of a default compile; an optimisation level in XLA_FLAGS stays the
user's. The comparison runs in a child without the tests' fast-compile flags, on the tiny
transformer of configs/ (its initializer compiled in 3.5 s by default, 1.3 s at level 1)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from spmd.engine.state import run_once_options
from tests.helpers.env import REPO, clean_env

SAME_BITS = """
import sys, jax, numpy as np
from spmd.config.load import build_task, load_config
from spmd.engine.engine_config import EngineSections
from spmd.engine.mesh import build_mesh
from spmd.engine.runtime import build_runtime
cfg = load_config(sys.argv[1], ["mesh.strategy=fsdp_tp"])
rt = build_runtime(cfg.engine_sections(), build_mesh(cfg.mesh, jax.devices()), build_task(cfg))
once, default = rt.init(), rt.init.jitted()
pairs = list(zip(jax.tree.leaves(once), jax.tree.leaves(default), strict=True))
assert len(pairs) > 10 and all(np.array_equal(a, b) for a, b in pairs), "init bits differ"
print("same bits", len(pairs))
"""


@pytest.mark.slow
def test_the_initializer_compiled_at_level_1_gives_the_default_bits():
    env = clean_env(fast_compile=False, compile_cache=False, JAX_NUM_CPU_DEVICES="8")
    r = subprocess.run([sys.executable, "-c", SAME_BITS, str(REPO / "configs" /
                        "transformer_tiny.yaml")], env=env, capture_output=True, text=True,
                       timeout=300, cwd=REPO)
    assert r.returncode == 0 and "same bits" in r.stdout, r.stderr[-3000:]


def test_run_once_options_leave_a_users_level_alone(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    assert run_once_options() == {"xla_backend_optimization_level": 1}
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")
    assert run_once_options() == {}
