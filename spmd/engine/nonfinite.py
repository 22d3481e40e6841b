"""Switching `train.nonfinite` between jobs of one run: the restore maps the optimizer state.

Under `skip` the optimizer state is wrapped in `optax.ApplyIfFiniteState` (its skip counters
around the update rule's own state; spmd.engine.state.make_optimizer), under `stop` it is
not. A checkpoint holds the form of the job that saved it, so a job whose mode differs from
the previous job's (the run's config.yaml) restores onto the saved form
(`nonfinite_restore_target`) and converts the result to its own (`nonfinite_switched`).
Checkpoints of either mode, including those written before this module, restore under both.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

__all__ = ["nonfinite_restore_target", "nonfinite_switched"]


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
