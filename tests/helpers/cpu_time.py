"""A pytest plugin for budgeting the suite: each test's CPU seconds, children included.

Why: under pytest-xdist on 2 cores the suite is bound by CPU, not by any one test's wall
time (a test that sleeps costs the other worker nothing), so what a test costs the 25-minute
budget is its CPU time: this process's and that of every child it waited for (ranks,
`spmd run`, launchers; not processes a scheduler started, such as Slurm's).

    SPMD_TEST_CPU_LOG=cpu.log python -m pytest -p tests.helpers.cpu_time
    sort -rn cpu.log | head -30

appends one line per test to $SPMD_TEST_CPU_LOG: `CPU_S WALL_S NODEID` (module fixtures
count in the first test that uses them). Without the variable it records nothing.
"""

from __future__ import annotations

import os
import resource
import time

import pytest

LOG_VAR = "SPMD_TEST_CPU_LOG"


def cpu_seconds() -> float:
    """User + system time of this process and of its waited-for children."""
    own, children = (resource.getrusage(w)
                     for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    path = os.environ.get(LOG_VAR)
    cpu, wall = cpu_seconds(), time.monotonic()
    yield
    if path:
        with open(path, "a") as f:
            f.write(f"{cpu_seconds() - cpu:.2f} {time.monotonic() - wall:.2f} {item.nodeid}\n")
