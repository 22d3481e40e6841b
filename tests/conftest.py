"""Shared test set-up: the test environment (tests.helpers.env, before jax) and fixtures.

Helpers live in the importable package `tests.helpers`; this file holds only fixtures.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest  # noqa: E402

import tests.helpers.env  # noqa: F401  (before anything imports jax: 8 CPU devices, one cache)


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
