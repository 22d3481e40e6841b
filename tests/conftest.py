"""Shared test set-up: the test environment (tests.helpers.env, before jax) and fixtures.

Helpers live in the importable package `tests.helpers`; this file holds only fixtures.
"""

from __future__ import annotations

from pathlib import Path

import pytest  # noqa: E402

import tests.helpers.env  # noqa: F401  (before anything imports jax: 8 CPU devices, one cache)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"
