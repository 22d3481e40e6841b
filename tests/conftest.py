"""Shared test set-up: the test environment (tests.helpers.env, before jax), fixtures, and
the two tiers of the suite.

Helpers live in the importable package `tests.helpers`; this file holds only fixtures and the
`slow` marking. The fast tier, `pytest -m "not slow"`, is the edit loop (in-process, a few
minutes on 2 cores); the full suite, which .ci/run runs, adds every test marked `slow`:
- every test under tests/multiprocess, tests/slurm, tests/openmpi and tests/multinode (real
  ranks, real schedulers, namespace nodes), marked here by directory;
- every in-process training test: those that use the `keep_signal_handlers` fixture (a run
  in the test process installs its preemption handlers), marked here by that fixture;
- any other test that takes more than a few seconds, marked in its own module.
Under pytest-xdist (`-n N`) each test module runs whole on one worker (its module fixtures,
such as a shared training run, are made once), and the tests that install or start
machine-wide services (the local Slurm, Debian's Open MPI: apt and slurmctld) share one
worker. CONTRIBUTING.md says how to run each tier.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
from pathlib import Path

import pytest  # noqa: E402

import tests.helpers.env  # noqa: F401  (before anything imports jax: 8 CPU devices, one cache)
from tests.helpers.env import compile_sources

# pytest caches each test module's rewritten bytecode only where Python may write bytecode; on
# an image with PYTHONDONTWRITEBYTECODE each worker rewrote and compiled every test module
# again at collection (17 s of CPU per worker against 6 s, 2026-11-30, 2 cores). The test
# processes write it, as Python does by default; the children only read (compile_sources).
sys.dont_write_bytecode = False

SLOW_DIRS = ("multiprocess", "slurm", "openmpi", "multinode")
# apt-get installs, the one local Slurm and the multi-node namespace cluster: one worker
SYSTEM_DIRS = ("slurm", "openmpi", "multinode")


def _test_dirs(item: pytest.Item) -> tuple[str, ...]:
    parts = Path(str(item.path)).parts
    return parts[parts.index("tests") + 1:-1] if "tests" in parts else ()


# The longest modules (minutes each on 2 cores) start first, so that under pytest-xdist no
# worker is left with one of them at the end while the other idles. Order only: every test
# is independent of the others.
LONG_FIRST = ("tests/multiprocess/test_main_job.py", "tests/unit/models/test_scan_remat.py",
              "tests/multiprocess/test_examples.py", "tests/slurm/", "tests/openmpi/",
              "tests/multinode/",
              "tests/multiprocess/test_fno_train.py", "tests/unit/benchmarks/test_benchmarks.py",
              "tests/multiprocess/test_optimizer_names.py",
              "tests/multiprocess/test_pipeline_checkpoint.py")


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto` (pyproject's addopts): 2 workers, or SPMD_TEST_WORKERS. Measured on 2 cores
    (docs/performance.md, "8. Start-up of a rank"; the run in benchmarks/results/LOG.md,
    2026-11-29): 3 workers gain nothing on 2 (33:49 against 34:30, more CPU): the suite is
    CPU-bound. -n 0 runs in one process (pdb, -x on the first failure)."""
    return int(os.environ.get("SPMD_TEST_WORKERS", min(2, os.cpu_count() or 1)))


@pytest.hookimpl(tryfirst=True)   # before xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the slow tier (multi-process directories and in-process training) and group the
    tests for pytest-xdist's `--dist loadgroup` (module doc)."""
    for item in items:
        dirs = _test_dirs(item)
        trains = "keep_signal_handlers" in getattr(item, "fixturenames", ())
        if (any(d in dirs for d in SLOW_DIRS) or trains) and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("xdist_group") is None:
            module = item.nodeid.split("::")[0]
            system = any(d in dirs for d in SYSTEM_DIRS)
            item.add_marker(pytest.mark.xdist_group("system" if system else module))
    items.sort(key=_start_rank)   # stable: the rest keep their order


def pytest_configure(config: pytest.Config) -> None:
    """Refuse a pytest whose node ids pytest-xdist cannot rewrite: `--dist loadgroup` puts a
    test's group in its node id (item._nodeid), which pytest 9.2 no longer reads (it keeps a
    structured id), so the groups split across workers: module fixtures run once per worker
    and the system tests run side by side. pyproject.toml's dev extra pins pytest < 9.1.

    Then, in the controller, before the workers start: the repo's bytecode
    (`compile_sources`); and in each process that collects tests, the garbage collector off
    until they are collected (`pytest_collection_finish`)."""
    version = tuple(int(p) for p in pytest.__version__.split(".")[:2] if p.isdigit())
    if config.getoption("dist", "no") == "loadgroup" and version >= (9, 1):
        raise pytest.UsageError(
            f"pytest {pytest.__version__}: pytest-xdist's --dist loadgroup (pyproject.toml "
            f"addopts) cannot group tests under pytest >= 9.1; install the dev extra's "
            f"versions: pip install -e '.[local,dev]'")
    if not hasattr(config, "workerinput"):
        compile_sources()
    if hasattr(config, "workerinput") or config.getoption("numprocesses", None) in (None, 0):
        gc.disable()   # a process that collects the tests: until they are collected


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze what collecting loaded (JAX, Flax and every test module) and turn the garbage
    collector back on, as `spmd.cli.main.load_stack` does in each rank: the collector's full
    passes leave those objects out from then on (collecting went from 13 to 8 s of CPU per
    worker, 2026-11-30, 2 cores)."""
    gc.collect()
    gc.freeze()
    gc.enable()


def _start_rank(item: pytest.Item) -> int:
    return next((i for i, prefix in enumerate(LONG_FIRST) if item.nodeid.startswith(prefix)),
                len(LONG_FIRST))


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"


@pytest.fixture
def keep_signal_handlers():
    """A run in the test process installs its preemption signal handlers; put pytest's back.

    Test modules that train in-process use it for every test:
    `pytestmark = pytest.mark.usefixtures("keep_signal_handlers")`.
    """
    watched = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
    saved = {s: signal.getsignal(s) for s in watched}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)
