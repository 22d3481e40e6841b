"""The `lr` of metrics.jsonl is the optimizer's own schedule: update k uses schedule(k - 1)."""

from __future__ import annotations

import numpy as np
import optax
import pytest

from spmd.config.schema import Config
from spmd.engine.state import learning_rate, make_optimizer


def cfg(**sections) -> Config:
    return Config.model_validate(sections)


def test_schedule_is_warmup_then_constant():
    schedule = learning_rate(cfg(optimizer={"lr": 0.1}, schedule={"warmup_steps": 4}))
    assert [float(schedule(k)) for k in (0, 2, 4, 10)] == pytest.approx([0.0, 0.05, 0.1, 0.1])
    assert float(learning_rate(cfg(optimizer={"lr": 0.2}))(7)) == pytest.approx(0.2)


def test_the_optimizer_steps_with_that_schedule():
    """AdamW moves a weight by lr for a constant unit gradient (m / sqrt(v) = 1)."""
    c = cfg(optimizer={"lr": 0.1, "grad_clip": None}, schedule={"warmup_steps": 2})
    tx = make_optimizer(c)
    params = {"w": np.zeros(3, np.float32)}
    state = tx.init(params)
    moves = []
    for _ in range(3):
        updates, state = tx.update({"w": np.ones(3, np.float32)}, state, params)
        moves.append(float(-updates["w"][0]))
        params = optax.apply_updates(params, updates)
    expected = [float(learning_rate(c)(k)) for k in range(3)]
    assert moves == pytest.approx(expected, rel=1e-3)
