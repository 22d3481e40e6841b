"""Switching `train.nonfinite` between jobs of one run: the restore maps the optimizer state.

Under `skip` the optimizer state is wrapped in `optax.ApplyIfFiniteState` (its skip counters
around the update rule's own state; spmd.engine.state.make_optimizer), under `stop` it is
not. A checkpoint holds the form of the job that saved it, so a job whose mode differs from
the previous job's (the run's config.yaml) restores onto the saved form
(`nonfinite_restore_target`) and converts the result to its own (`nonfinite_switched`).
Checkpoints of either mode, including those written before this module, restore under both.

The previous job's mode names the form of the steps that job saved, not of older ones: a
restore that falls back to an older step (the newest is damaged, or a node-local tier was
lost) may meet the other form. `restore_any_form` restores onto the predicted form first and,
when that fails, onto the other one, so such a step restores too (and is converted).
Left: the local tier skips a copy whose layout is not the predicted form's (it does not
fail), so after two switches of mode and a job that ended before its first save, an older
local step of the predicted form may be restored in place of a newer one of the other
form (logged as "local checkpoint skipped"); a record of each step's form would close it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import optax

__all__ = ["form_of", "nonfinite_restore_target", "nonfinite_switched", "restore_any_form"]

log = logging.getLogger("spmd.engine")
R = TypeVar("R")


def nonfinite_restore_target(abstract: Any, saved: str | None) -> Any:
    """The restore target for a checkpoint saved under `train.nonfinite: saved` (the
    previous job's; None: unknown, taken as this run's): under `skip` the optimizer state is
    wrapped in `optax.ApplyIfFiniteState` (`make_optimizer`), under `stop` it is not, so a
    run may switch between the two between jobs. `abstract` is this run's state; the
    wrapper's counters are replicated scalars, like `step`."""
    wrapped = isinstance(abstract.opt_state, optax.ApplyIfFiniteState)
    if saved is None or (saved == "skip") == wrapped:
        return abstract
    if wrapped:   # saved under stop, restored under skip
        return abstract.replace(opt_state=abstract.opt_state.inner_state)
    sharding = abstract.step.sharding
    scalar = jax.ShapeDtypeStruct((), jnp.int32, sharding=sharding)
    return abstract.replace(opt_state=optax.ApplyIfFiniteState(
        notfinite_count=scalar, last_finite=jax.ShapeDtypeStruct((), jnp.bool_,
                                                                 sharding=sharding),
        total_notfinite=scalar, inner_state=abstract.opt_state))


def nonfinite_switched(state: Any, abstract: Any) -> Any:
    """A state restored onto `nonfinite_restore_target(abstract, ...)`, in `abstract`'s form:
    from `skip` to `stop` the counters are dropped; from `stop` to `skip` they start at 0
    (no skips yet in a row, nor in all: `skips` counts from this job on)."""
    have = isinstance(state.opt_state, optax.ApplyIfFiniteState)
    want = isinstance(abstract.opt_state, optax.ApplyIfFiniteState)
    if have == want:
        return state
    if have:
        return state.replace(opt_state=state.opt_state.inner_state)
    target = abstract.opt_state
    return state.replace(opt_state=optax.ApplyIfFiniteState(
        notfinite_count=jax.device_put(jnp.zeros((), jnp.int32),
                                       target.notfinite_count.sharding),
        last_finite=jax.device_put(jnp.array(True), target.last_finite.sharding),
        total_notfinite=jax.device_put(jnp.zeros((), jnp.int32),
                                       target.total_notfinite.sharding),
        inner_state=state.opt_state))


def form_of(state: Any) -> str:
    """The `train.nonfinite` mode whose form `state`'s optimizer state has: skip or stop."""
    return "skip" if isinstance(state.opt_state, optax.ApplyIfFiniteState) else "stop"


def restore_any_form(restore: Callable[[Any], R], abstract: Any, saved: str | None,
                     errors: tuple[type[BaseException], ...]) -> tuple[R, Any]:
    """`restore(target)` onto the form that `saved` (the previous job's mode; None: unknown)
    predicts, and, when that raises one of `errors` (a fallback to an older step saved in
    the other mode: the optimizer state's tree differs), onto the other form. Returns the
    result and the target it was restored onto (convert it with `nonfinite_switched`).
    When both fail, the first error is raised: the other form was only a guess."""
    first = nonfinite_restore_target(abstract, saved)
    try:
        return restore(first), first
    except errors as error:
        other = nonfinite_restore_target(abstract, "stop" if form_of(first) == "skip"
                                         else "skip")
        log.info("restoring onto the optimizer state of train.nonfinite=%s failed (%s); "
                 "trying the train.nonfinite=%s form (an older step saved in the other mode)",
                 form_of(first), str(error).splitlines()[0][:200], form_of(other))
        try:
            return restore(other), other
        except errors:
            raise error from None
