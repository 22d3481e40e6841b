"""Shared test set-up: 8 CPU devices in the pytest process, helpers to run the CLI."""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

# Before anything imports jax: this process gets 8 CPU devices, subprocesses choose their own.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["JAX_NUM_CPU_DEVICES"] = "8"

# One persistent XLA compilation cache per test session (a fresh directory, removed at exit),
# shared by this process and every child `spmd`: dozens of tests compile the same small
# programs, and a resumed run recompiles what the first run compiled. Benchmarks, which time
# compilation, run without it (`clean_env(compile_cache=False)`).
XLA_CACHE = {"JAX_COMPILATION_CACHE_DIR": tempfile.mkdtemp(prefix="spmd-tests-xla-cache-"),
             "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
             "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"}
os.environ.update(XLA_CACHE)
atexit.register(shutil.rmtree, XLA_CACHE["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ON_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def clean_env(compile_cache: bool = True, **extra: str) -> dict[str, str]:
    """The environment for a child `spmd`: no launcher variables leaking in from outside."""
    prefixes = ("SLURM_", "PMI_", "PMIX_", "OMPI_", "FLUX_", "JSM_", "LSB_", "PALS_", "PBS_",
                "SPMD_", "MPI_LOCAL", "HYDRA_", "JAX_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
    env.update({"JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"})
    if compile_cache:
        env.update(XLA_CACHE)
    env.update(extra)
    return env


def run_spmd(*args: str, env: dict[str, str] | None = None, timeout: float = 300,
             cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run `python -m spmd.cli ARGS` and capture its output."""
    return subprocess.run(
        [sys.executable, "-m", "spmd.cli", *args], capture_output=True, text=True,
        env=env or clean_env(), timeout=timeout, cwd=cwd or REPO,
    )


# What the checkpointer needs of a LaunchEnv, for a single process (in-process unit tests).
ONE_PROCESS = SimpleNamespace(rank=0, size=1, node_of_rank=(0,), num_nodes=1)


class RecordedEvents:
    """An EventLog stand-in that keeps the emitted events in memory."""

    def __init__(self):
        self.records = []

    def emit(self, event, **fields):
        self.records.append({"event": event, **fields})

    def of(self, name):
        return [r for r in self.records if r["event"] == name]


def require(condition: bool, reason: str) -> None:
    """Skip locally when a prerequisite is missing; fail on CI, where it must be there."""
    if not condition:
        if ON_CI:
            pytest.fail(f"prerequisite missing on CI: {reason}")
        pytest.skip(reason)


def train_steps(rt, steps: int) -> tuple[list[float], dict]:
    """Train a built runtime in this process for `steps` steps: (losses, final state)."""
    state = rt.init()
    source = rt.task.train_source()
    losses = []
    for step in range(steps):
        state, metrics = rt.train_step(state, rt.feed.global_batch(source, step))
        losses.append(float(metrics["loss"]))
    return losses, state


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"
