"""Optimizers and learning-rate schedules: the `optimizer:` and `schedule:` sections.

A low layer (optax, jax and pydantic only): the config schema imports its sections, the
engine builds the train state's optimizer from them (`spmd.engine.state.make_optimizer`).
"""

from spmd.optim.optimizers import (
    OPTIMIZERS,
    PARAMETERS,
    OptimizerConfig,
    build_optimizer,
    decay_mask,
    decays,
    with_clipping,
)
from spmd.optim.schedules import SCHEDULES, ScheduleConfig, build_schedule

__all__ = ["OPTIMIZERS", "PARAMETERS", "SCHEDULES", "OptimizerConfig", "ScheduleConfig",
           "build_optimizer", "build_schedule", "decay_mask", "decays", "with_clipping"]
