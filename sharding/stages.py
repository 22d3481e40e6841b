"""Pipeline stages: what a stage is, and the GPipe forward that both schedules run.

Shared by `pipeline` (which decides whether and how to pipeline, and calls a schedule) and
`one_f_one_b` (whose `jax.custom_vjp` reuses `gpipe_forward` as its forward rule). Imports
point one way: `pipeline -> one_f_one_b -> stages` and `pipeline -> stages`; nothing here
imports either of them.

Invariants:
- `Stages.count` S > 1 devices along `Stages.axes`; every staged array has the stage as its
  leading dimension, pinned there by `on_stages` (the other dimensions are left to XLA).
- One stage runs its L/S layers in order as a scan (`stage_function`); all S stages run in
  lockstep under `jax.vmap(..., spmd_axis_name=axes)`, and `jnp.roll` over the leading
  dimension moves activations one stage on (a collective-permute).
- `gpipe_forward` computes exactly the unpipelined stack on every microbatch; bubble ticks
  compute on zeros or stale slots whose results are never read (see its docstring).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

Schedule = Literal["gpipe", "1f1b"]
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b")
Block = Callable[[Any, jax.Array], jax.Array]


@dataclass(frozen=True)
class PipelineSchedule:
    """How to run the stages: M microbatches under `schedule`, each through the stages
    `repeats` times (circular: stage k holds layer chunks k, k + S, ..., gpipe only)."""

    microbatches: int = 1
    schedule: Schedule = "gpipe"
    repeats: int = 1


@dataclass(frozen=True)
class Stages:
    """The bound pipeline: S = `count` stages over the mesh `axes`, run under `schedule`."""

    mesh: Mesh
    axes: tuple[str, ...]
    count: int
    schedule: PipelineSchedule


def on_stages(x: jax.Array, stages: Stages) -> jax.Array:
    """Pin the leading dimension to the stage axes, leave the rest to the compiler."""
    spec = P(stages.axes, *([P.UNCONSTRAINED] * (x.ndim - 1)))
    return jax.lax.with_sharding_constraint(x, NamedSharding(stages.mesh, spec))


def per_stage(mask: jax.Array, x: jax.Array) -> jax.Array:
    """Broadcast a (S,) mask against an array whose leading dimension is the stage."""
    return mask.reshape(mask.shape + (1,) * (x.ndim - 1))


def stage_function(block: Block) -> Callable[[Any, jax.Array], jax.Array]:
    """One stage: its L/S layers in order, as a scan."""

    def stage(params: Any, h: jax.Array) -> jax.Array:
        def body(carry, layer_params):
            return block(layer_params, carry), None

        return jax.lax.scan(body, h, params)[0]

    return stage


def gpipe_forward(block: Block, staged: Any, xs: jax.Array, stages: Stages) -> jax.Array:
    """All microbatches forward through all stages, R times: R M + S - 1 ticks; (M, mb, ...) out.

    Stage k works at tick t on item u = t - k (valid for 0 <= u < R M): microbatches go in
    groups of S, each group through all R repeats, so u = g R S + j S + i is microbatch
    g S + i in repeat j. Stage 0 takes a new microbatch in repeat 0 and stage S - 1's
    previous output (the roll wraps around) in later ones. With R = 1, u is the microbatch.
    The last stage's result is written to its microbatch's slot in the last repeat; earlier
    writes (u < 0, clipped to slot 0) are overwritten by the real one, so no masking is needed
    for R = 1; for R > 1 writes in other repeats put the slot's value back.
    """
    s, m = stages.count, xs.shape[0]
    r = stages.schedule.repeats
    run = jax.vmap(stage_function(block), spmd_axis_name=stages.axes)
    k = jnp.arange(s)
    first = k == 0
    pick = jax.vmap(lambda p, j: jax.tree.map(
        lambda a: jax.lax.dynamic_index_in_dim(a, j, 0, keepdims=False), p),
        spmd_axis_name=stages.axes)

    def tick(carry, t):
        buf, outputs = carry
        u = jnp.clip(t - k, 0, r * m - 1)
        repeat, item = (u % (r * s)) // s, (u // (r * s)) * s + u % s
        fresh = first if r == 1 else first & (repeat == 0)
        new = jax.lax.dynamic_index_in_dim(xs, item[0], 0, keepdims=False)
        buf = on_stages(jnp.where(per_stage(fresh, buf), new[None], buf), stages)
        params = staged if r == 1 else pick(staged, repeat)
        out = on_stages(run(params, buf), stages)
        result = out[s - 1]
        if r > 1:
            kept = jax.lax.dynamic_index_in_dim(outputs, item[s - 1], 0, keepdims=False)
            result = jnp.where(repeat[s - 1] == r - 1, result, kept)
        outputs = jax.lax.dynamic_update_index_in_dim(outputs, result, item[s - 1], 0)
        return (jnp.roll(out, 1, axis=0), outputs), None

    buf = on_stages(jnp.zeros((s, *xs.shape[1:]), xs.dtype), stages)
    (_, outputs), _ = jax.lax.scan(tick, (buf, jnp.zeros_like(xs)),
                                   jnp.arange(r * m + s - 1))
    return outputs
