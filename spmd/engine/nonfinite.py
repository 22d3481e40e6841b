"""Switching `train.nonfinite` between jobs of one run: the restore maps the optimizer state.

Under `skip` the optimizer state is wrapped in `optax.ApplyIfFiniteState` (its skip counters
around the update rule's own state; spmd.engine.state.make_optimizer), under `stop` it is
not. A checkpoint holds the form of the job that saved it, so a job whose mode differs from
the previous job's (the run's config.yaml) restores onto the saved form
(`nonfinite_restore_target`) and converts the result to its own (`nonfinite_switched`).
Checkpoints of either mode, including those written before this module, restore under both.

The previous job's mode names the form of the steps that job saved, not of older ones: a
restore that falls back to an older step (the newest is damaged, or a node-local tier was
lost) may meet the other form. So:
- the run records the mode of each job from the step it starts at (`record_form`, in
  run.dir/nonfinite_forms.json), and the form predicted for a restore is that of the newest
  step (`saved_form`), not the previous job's: a node-local copy in another layout than the
  predicted one is skipped, not failed, so a wrong guess could restore an older step;
- `restore_any_form` restores onto the predicted form first and, when that fails (a fallback
  to an older step, or a run from before the record), onto the other one; either is
  converted into this job's form.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import optax

from spmd.atomic_write import write_atomic

__all__ = ["FORMS_FILE", "form_of", "nonfinite_restore_target", "nonfinite_switched",
           "record_form", "restore_any_form", "saved_form"]

FORMS_FILE = "nonfinite_forms.json"   # in run.dir: [[first step, mode], ...], a job each

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


def _forms(run_dir: Path) -> list[tuple[int, str]]:
    try:
        entries = json.loads((Path(run_dir) / FORMS_FILE).read_text())
        return [(int(start), str(mode)) for start, mode in entries
                if str(mode) in ("stop", "skip")]
    except (OSError, ValueError, TypeError):
        return []   # none yet (a run from before the record), or unreadable: not known


def saved_form(run_dir: Path, step: int | None) -> str | None:
    """The `train.nonfinite` mode whose form checkpoint `step` holds: that of the last job
    that started before it (run.dir/nonfinite_forms.json); None: not recorded."""
    if step is None:
        return None
    earlier = [mode for start, mode in _forms(run_dir) if start < step]
    return earlier[-1] if earlier else None


def record_form(run_dir: Path, start: int, mode: str) -> None:
    """Rank 0, once this job's state is restored (or initialized) at step `start`: the steps
    it saves, after `start`, hold `mode`'s form. The entries of jobs that started at or after
    `start` go: the steps they saved are gone with this restore of an older one."""
    entries = [[s, m] for s, m in _forms(run_dir) if s < start] + [[int(start), mode]]
    path = Path(run_dir) / FORMS_FILE
    try:
        write_atomic(path, json.dumps(entries) + "\n", durable=False)
    except OSError as e:   # the restore then guesses from config.yaml, and retries
        log.warning("could not record the train.nonfinite form of this job's steps in %s: %s",
                    path, e)
