"""The environment of the test processes and of every child `spmd` they start.

Importing this module, before anything imports jax, gives the pytest process 8 CPU devices,
XLA flags that compile faster (FAST_COMPILE) and one persistent XLA compilation cache per test
session (a fresh directory, removed at exit), shared by this process and every child `spmd`:
dozens of tests compile the same small programs, and a resumed run recompiles what the first
run compiled. Benchmarks, which time compilation, run without the cache
(`clean_env(compile_cache=False)`).
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path
from typing import TypeVar

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["JAX_NUM_CPU_DEVICES"] = "8"

# XLA's CPU backend with LLVM's cheap optimisations: the tests' programs are tiny and run a few
# steps, so compiling takes most of their CPU time, and these flags cut it by about a fifth
# (measured on 2 cores: tests/multiprocess/test_plugin_task.py, user CPU 49 -> 40 s). The
# numbers differ from a default build only in rounding, and the pytest process and every child
# compile alike, so runs still match bit for bit. A long run (the README's main job) runs
# without them: `clean_env(fast_compile=False)`.
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def _jaxlib_version() -> tuple[int, ...]:
    try:
        return tuple(int(p) for p in re.findall(r"\d+", metadata.version("jaxlib"))[:3])
    except metadata.PackageNotFoundError:
        return ()


# And XLA's legacy CPU fusion emitters where jaxlib still has them: the MLIR fusion emitters
# (the default) took 1.7x the CPU to compile and run the same tiny programs (2026-11-30,
# jaxlib 0.10.2, 2 cores: the transformer under fsdp_tp and dp and the MLP, 3 steps each,
# 20.3 against 11.8 s, the same losses). jaxlib 0.11.1 dropped the switch, and XLA ends the
# process on a flag it does not know, so newer stacks compile with the default.
if (0,) < _jaxlib_version() < (0, 11, 1):
    FAST_COMPILE += " --xla_cpu_use_fusion_emitters=false"
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip()

XLA_CACHE = {"JAX_COMPILATION_CACHE_DIR": tempfile.mkdtemp(prefix="spmd-tests-xla-cache-"),
             "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
             "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"}
os.environ.update(XLA_CACHE)
atexit.register(shutil.rmtree, XLA_CACHE["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)

REPO = Path(__file__).resolve().parents[2]
ON_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def clean_env(compile_cache: bool = True, fast_compile: bool = True,
              **extra: str) -> dict[str, str]:
    """The environment for a child `spmd`: no launcher variables leaking in from outside;
    XLA_FLAGS with FAST_COMPILE unless `fast_compile` is False."""
    prefixes = ("SLURM_", "PMI_", "PMIX_", "OMPI_", "FLUX_", "JSM_", "LSB_", "PALS_", "PBS_",
                "SPMD_", "MPI_LOCAL", "HYDRA_", "JAX_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
    env.update({"JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"})
    if compile_cache:
        env.update(XLA_CACHE)
    if not fast_compile:
        env["XLA_FLAGS"] = env.get("XLA_FLAGS", "").replace(FAST_COMPILE, "").strip()
        if not env["XLA_FLAGS"]:
            del env["XLA_FLAGS"]
    env.update(extra)
    return env


# The repo's Python sources, as packages or scripts that the tests and their children import.
SOURCE_DIRS = ("spmd", "launch", "sharding", "models", "jobscripts", "benchmarks", "examples",
               "tests")


def compile_sources(root: Path = REPO) -> None:
    """Write the bytecode of `root`'s Python sources beside them (`__pycache__`, git-ignored),
    before any worker or child imports them.

    Where PYTHONDONTWRITEBYTECODE is set (as on the CI image), Python never writes bytecode, so
    every process of the suite (hundreds of ranks and CLI calls) compiled the repo's modules
    from source again: 0.5 s of CPU of the 2.3 s that a rank's imports take (2026-11-30, 2
    cores, `import spmd.loop.trainer, spmd.tasks.regression`, 2.27 against 1.80 s). Reading
    bytecode is still allowed there; only writing it is left to this one call. A file that
    does not compile is reported by the test that imports it, not here."""
    import compileall

    for d in SOURCE_DIRS:
        if (root / d).is_dir():
            compileall.compile_dir(root / d, quiet=2, workers=0)


def run_spmd(*args: str, env: dict[str, str] | None = None, timeout: float = 300,
             cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run `python -m spmd.cli ARGS` and capture its output."""
    return subprocess.run(
        [sys.executable, "-m", "spmd.cli", *args], capture_output=True, text=True,
        env=env or clean_env(), timeout=timeout, cwd=cwd or REPO,
    )


T = TypeVar("T")


def side_by_side(*calls: Callable[[], T]) -> list[T]:
    """Independent calls that each run child processes (runs in separate run dirs), all at
    once: one job's idle waits (MPI start-up, barriers, a rank's bootstrap) overlap the
    other's work. Their results in order; the first error is raised."""
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(call) for call in calls]
        return [f.result() for f in futures]


def require(condition: bool, reason: str) -> None:
    """Skip locally when a prerequisite is missing; fail on CI, where it must be there."""
    if not condition:
        if ON_CI:
            pytest.fail(f"prerequisite missing on CI: {reason}")
        pytest.skip(reason)


def mpiexec_path() -> str:
    """The mpiexec that `spmd run` itself uses (`spmd.cli.run_cmd.find_mpiexec`:
    $SPMD_MPIEXEC, next to this Python, else on PATH), found the one way for every test: a
    venv whose bin is not on PATH still has its mpich wheel's. None: skip locally, fail on CI."""
    from spmd.cli.run_cmd import find_mpiexec
    from spmd.errors import SpmdError

    try:
        return str(find_mpiexec())
    except SpmdError as e:
        require(False, f"mpiexec: {e}")
        raise                                   # unreachable: require skipped or failed
