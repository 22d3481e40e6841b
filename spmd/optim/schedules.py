"""The `schedule:` section and the learning-rate schedule it names (optax schedules).

The peak learning rate is `optimizer.lr`; every schedule starts with a linear warm-up from 0
over `warmup_steps` updates (none when 0). After warm-up:

- `constant`: the peak.
- `cosine`: a cosine decay to `min_lr_ratio` x peak over the decay steps
  (`optax.warmup_cosine_decay_schedule`).
- `linear`: a linear decay to `min_lr_ratio` x peak over the decay steps.
- `wsd` (warm-up, stable, decay): the peak until the last `decay_steps` updates of
  `train.steps`, then a linear decay to `min_lr_ratio` x peak.
- `rsqrt`: peak x sqrt(max(warmup_steps, 1) / step) (inverse square root, as T5).
- `step`: piecewise constant, multiplied by `factor` at each step of `boundaries`.

Decay steps: `decay_steps`, else `decay_fraction` x `train.steps`, else (`cosine`,
`linear`) the updates left after warm-up, (`wsd`) 10 % of `train.steps`. A schedule that
has ended holds its last value (a run extended past it trains on at `min_lr_ratio` x peak).
Step k of a schedule is optax's count: the update that makes step k + 1.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

if TYPE_CHECKING:
    import optax

SCHEDULES = ("constant", "cosine", "linear", "wsd", "rsqrt", "step")
WSD_DEFAULT_FRACTION = 0.1


class ScheduleConfig(BaseModel):
    """schedule: the learning rate over the updates (peak: optimizer.lr)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Literal["constant", "cosine", "linear", "wsd", "rsqrt", "step"] = Field(
        "constant", description="The shape after the warm-up: constant; cosine and linear "
        "decay to min_lr_ratio x peak over the decay steps; wsd (warmup-stable-decay) holds "
        "the peak, then decays linearly over the last decay steps; rsqrt decays as "
        "1/sqrt(step); step multiplies by `factor` at each of `boundaries`.")
    warmup_steps: int = Field(
        0, ge=0, description="Updates of linear warm-up from 0 to optimizer.lr.")
    decay_steps: int | None = Field(
        None, ge=1, description="Updates the decay lasts (cosine, linear, wsd). null: "
        "decay_fraction of train.steps when set, else for wsd 0.1 of them, else every update "
        "after the warm-up.")
    decay_fraction: float | None = Field(
        None, gt=0, le=1, description="The decay's share of train.steps, instead of "
        "decay_steps (wsd default: 0.1).")
    min_lr_ratio: float = Field(
        0.0, ge=0, le=1, description="Where the decay ends, as a fraction of optimizer.lr.")
    boundaries: list[int] = Field(
        default_factory=list, description="`step`: the updates at which the learning rate "
        "is multiplied by `factor` (increasing, >= 1).")
    factor: float = Field(
        0.1, gt=0, description="`step`: the factor applied at each boundary.")

    @model_validator(mode="after")
    def _consistent(self) -> ScheduleConfig:
        if self.decay_steps is not None and self.decay_fraction is not None:
            raise ValueError("schedule.decay_steps and schedule.decay_fraction are "
                             "alternatives: set one")
        if self.name == "step":
            if not self.boundaries:
                raise ValueError("schedule.name=step needs schedule.boundaries (the updates at "
                                 "which the learning rate is multiplied by schedule.factor)")
            if sorted(self.boundaries) != self.boundaries or min(self.boundaries) < 1:
                raise ValueError(f"schedule.boundaries must be increasing steps >= 1, got "
                                 f"{self.boundaries}")
        elif self.boundaries:
            raise ValueError(f"schedule.boundaries is for schedule.name=step, not "
                             f"{self.name}")
        return self

    def decay(self, total_steps: int) -> int:
        """Updates the decay lasts (cosine, linear, wsd), at least 1."""
        if self.decay_steps is not None:
            return self.decay_steps
        if self.decay_fraction is not None:
            return max(round(self.decay_fraction * total_steps), 1)
        if self.name == "wsd":
            return max(round(WSD_DEFAULT_FRACTION * total_steps), 1)
        return max(total_steps - self.warmup_steps, 1)


def build_schedule(cfg: ScheduleConfig, peak: float, total_steps: int) -> optax.Schedule:
    """The schedule of `cfg` with peak learning rate `peak` for a run of `total_steps`."""
    import jax.numpy as jnp  # here: the config schema imports this module, not optax
    import optax

    warmup, end = cfg.warmup_steps, peak * cfg.min_lr_ratio
    if cfg.name == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, peak, warmup,
                                                  warmup + cfg.decay(total_steps), end)
    if cfg.name == "constant":
        after = optax.constant_schedule(peak)
    elif cfg.name == "linear":
        after = optax.linear_schedule(peak, end, cfg.decay(total_steps))
    elif cfg.name == "wsd":
        decay = cfg.decay(total_steps)
        stable = max(total_steps - warmup - decay, 0)
        after = optax.join_schedules(
            [optax.constant_schedule(peak), optax.linear_schedule(peak, end, decay)], [stable])
    elif cfg.name == "rsqrt":
        scale = max(warmup, 1)

        def after(count):
            return peak * jnp.sqrt(scale / jnp.maximum(count + warmup, scale))
    else:  # step
        early = sum(b <= warmup for b in cfg.boundaries)   # boundaries inside the warm-up
        after = optax.piecewise_constant_schedule(
            peak * cfg.factor ** early,
            {b - warmup: cfg.factor for b in cfg.boundaries if b > warmup})
    if not warmup:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), after], [warmup])
