"""The `schedule:` section: each schedule equals optax's own functions at chosen steps."""

from __future__ import annotations

import numpy as np
import optax
import pytest

from spmd.config.load import load_config
from spmd.config.schema import Config
from spmd.engine.state import learning_rate
from spmd.errors import ConfigError
from spmd.optim import ScheduleConfig, build_schedule

PEAK, TOTAL, WARMUP = 0.3, 100, 10
STEPS = [0, 1, 5, 9, 10, 11, 25, 50, 79, 80, 81, 90, 99, 100, 150]


def values(schedule) -> list[float]:
    return [float(schedule(k)) for k in STEPS]


def ours(**section) -> list[float]:
    return values(build_schedule(ScheduleConfig(**section), PEAK, TOTAL))


def warm() -> optax.Schedule:
    return optax.linear_schedule(0.0, PEAK, WARMUP)


def test_constant_with_and_without_warmup():
    assert ours() == values(optax.constant_schedule(PEAK))
    assert ours(warmup_steps=WARMUP) == values(optax.join_schedules(
        [warm(), optax.constant_schedule(PEAK)], [WARMUP]))


def test_cosine_is_optax_warmup_cosine_decay():
    assert ours(name="cosine", warmup_steps=WARMUP, min_lr_ratio=0.1) == values(
        optax.warmup_cosine_decay_schedule(0.0, PEAK, WARMUP, TOTAL, 0.1 * PEAK))
    assert ours(name="cosine", decay_steps=50) == values(
        optax.warmup_cosine_decay_schedule(0.0, PEAK, 0, 50, 0.0))


def test_linear_decays_to_min_ratio_over_the_rest():
    assert ours(name="linear", warmup_steps=WARMUP, min_lr_ratio=0.2) == values(
        optax.join_schedules([warm(), optax.linear_schedule(PEAK, 0.2 * PEAK, TOTAL - WARMUP)],
                             [WARMUP]))


def test_wsd_warms_up_holds_then_decays_the_last_fraction():
    reference = optax.join_schedules(
        [warm(), optax.constant_schedule(PEAK), optax.linear_schedule(PEAK, 0.0, 20)],
        [WARMUP, TOTAL - 20])
    assert ours(name="wsd", warmup_steps=WARMUP, decay_fraction=0.2) == values(reference)
    assert ours(name="wsd", warmup_steps=WARMUP, decay_steps=20) == values(reference)
    default = build_schedule(ScheduleConfig(name="wsd"), PEAK, TOTAL)   # the last 10 %
    assert float(default(89)) == pytest.approx(PEAK) and float(default(100)) == 0.0


def test_step_multiplies_by_factor_at_the_boundaries():
    assert ours(name="step", boundaries=[30, 60], factor=0.5) == values(
        optax.piecewise_constant_schedule(PEAK, {30: 0.5, 60: 0.5}))
    with_warmup = build_schedule(ScheduleConfig(name="step", warmup_steps=WARMUP,
                                                boundaries=[30]), PEAK, TOTAL)
    assert [float(with_warmup(k)) for k in (5, 29, 30, 99)] == pytest.approx(
        [PEAK / 2, PEAK, PEAK * 0.1, PEAK * 0.1])


def test_rsqrt_is_peak_times_sqrt_warmup_over_step():
    got = ours(name="rsqrt", warmup_steps=WARMUP)
    expected = [PEAK * k / WARMUP if k < WARMUP else PEAK * np.sqrt(WARMUP / k) for k in STEPS]
    assert got == pytest.approx(expected, rel=1e-6)


def test_learning_rate_is_the_sections_schedule_over_train_steps():
    cfg = Config.model_validate({"train": {"steps": TOTAL},
                                 "optimizer": {"lr": PEAK},
                                 "schedule": {"name": "cosine", "warmup_steps": WARMUP}})
    assert values(learning_rate(cfg)) == values(
        optax.warmup_cosine_decay_schedule(0.0, PEAK, WARMUP, TOTAL, 0.0))


@pytest.mark.parametrize("overrides, message", [
    (["schedule.name=exp"], "schedule.name"),
    (["schedule.decay_steps=5", "schedule.decay_fraction=0.5"], "alternatives"),
    (["schedule.name=step"], "schedule.boundaries"),
    (["schedule.boundaries=[5]"], "schedule.name=step"),
    (["schedule.warmup=3"], "schedule.warmup_steps"),
])
def test_bad_schedules_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)
