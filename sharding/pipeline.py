"""Pipeline parallelism: the stacked `layers` axis split into stages over the mesh.

A pipeline is on whenever the bound rule table shards the logical axis `layers` over mesh
axes of total size S > 1 (presets `pp`, `pp_fsdp`). `models/scan.run_stacked` then calls
`run_pipeline` instead of its plain scan; the model file itself names no mesh axis.

The program stays one SPMD program (no per-stage process logic): the L stacked layers are
viewed as (S, L/S, ...) with the leading dimension on the stage axes, each tick runs every
stage on its slot of a stage buffer (`jax.vmap` with `spmd_axis_name`, so the blocks' own
activation constraints gain the stage axis), and the buffer is rotated one stage forward
with `jnp.roll`, which XLA partitions into a collective-permute.

Invariants:
- The batch is split into M microbatches by row index modulo M (row i goes to microbatch
  i % M), so each microbatch keeps the batch's data-parallel sharding; the output is put
  back in the original row order. The function computed is exactly `run_stacked`'s: every
  row goes through layers 0..L-1 in order, so losses and gradients equal the
  non-pipelined step's up to float summation order.
- `gpipe` runs M + S - 1 ticks forward; autodiff of that scan is the all-backward half.
  Bubble ticks compute on zeros or stale slots whose results are never read, so they
  receive zero cotangents.
- With `repeats` R > 1 (circular, gpipe only) the layers are viewed as (S, R, L/(S R), ...),
  stage k holding chunks k, k + S, ...; microbatches go round the stages R times in groups
  of S (M a multiple of S), R M + S - 1 ticks. The stored parameters keep layer order, so
  checkpoints do not depend on R; XLA moves the chunks between stages every step.
- `1f1b` is the same forward inside a `jax.custom_vjp`; its backward is an explicit
  schedule (see `_one_f_one_b_backward`).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from spmd.sharding.errors import ShardingError
from spmd.sharding.rules import RuleTable

LAYERS = "layers"
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


def stage_axes(rules: RuleTable, mesh_shape: dict[str, int]) -> tuple[str, ...]:
    """The mesh axes (of size > 1) that the parameter rule for `layers` shards over."""
    axes = rules.lookup(LAYERS) or ()
    return tuple(a for a in axes if mesh_shape.get(a, 1) > 1)


def num_stages(rules: RuleTable, mesh_shape: dict[str, int]) -> int:
    """S: how many pipeline stages the rules make on this mesh (1 = no pipeline)."""
    return math.prod(mesh_shape[a] for a in stage_axes(rules, mesh_shape))


def bubble_fraction(stages: int, microbatches: int, repeats: int = 1) -> float:
    """Idle fraction of a GPipe or 1F1B schedule: (S - 1) / (M + S - 1); with R repeats
    (circular) the fill and drain are paid once for R M chunk-ticks: (S - 1) / (R M + S - 1).

    Both schedules here have it: every stage computes in lockstep, and each stage-tick is
    either one of its M microbatches or bubble. GPipe runs M + S - 1 forward and M + S - 1
    backward ticks; 1F1B (`one_f_one_b`) runs M + S - 1 forward ticks (the loss is outside
    the stack) and then M + 2S - 2 ticks whose warm-up runs only forwards and whose
    cool-down only backwards, S - 1 + S - 1 + M of them, or M + S - 1 of each kind.
    """
    return (stages - 1) / (repeats * microbatches + stages - 1)


_SCHEDULE: contextvars.ContextVar[PipelineSchedule | None] = contextvars.ContextVar(
    "spmd_pipeline_schedule", default=None
)


@contextlib.contextmanager
def pipeline_schedule(schedule: PipelineSchedule | None) -> Iterator[None]:
    """Bind the microbatch count and schedule that `run_pipeline` uses (while tracing)."""
    token = _SCHEDULE.set(schedule)
    try:
        yield
    finally:
        _SCHEDULE.reset(token)


@dataclass(frozen=True)
class _Stages:
    mesh: Mesh
    axes: tuple[str, ...]
    count: int
    schedule: PipelineSchedule


def active_pipeline() -> _Stages | None:
    """The bound pipeline, or None when no binding shards `layers` over more than one device."""
    from spmd.sharding.annotate import current_binding

    binding = current_binding()
    if binding is None:
        return None
    shape = dict(binding.mesh.shape)
    axes = stage_axes(binding.rules, shape)
    if not axes:
        return None
    schedule = _SCHEDULE.get() or PipelineSchedule()
    return _Stages(binding.mesh, axes, num_stages(binding.rules, shape), schedule)


def _on_stages(x: jax.Array, stages: _Stages) -> jax.Array:
    """Pin the leading dimension to the stage axes, leave the rest to the compiler."""
    spec = P(stages.axes, *([P.UNCONSTRAINED] * (x.ndim - 1)))
    return jax.lax.with_sharding_constraint(x, NamedSharding(stages.mesh, spec))


def _split_microbatches(x: jax.Array, m: int) -> jax.Array:
    """(B, ...) -> (M, B/M, ...), row i into microbatch i % M (keeps the batch sharding)."""
    b = x.shape[0]
    return x.reshape(b // m, m, *x.shape[1:]).swapaxes(0, 1)


def _merge_microbatches(xs: jax.Array) -> jax.Array:
    m, mb = xs.shape[:2]
    return xs.swapaxes(0, 1).reshape(m * mb, *xs.shape[2:])


def run_pipeline(block: Block, state: Any, x: jax.Array, stages: _Stages) -> jax.Array:
    """x -> block_{L-1}(... block_0(x)) with the layers pipelined over `stages`."""
    s, m, r = stages.count, stages.schedule.microbatches, stages.schedule.repeats
    num_layers = jax.tree.leaves(state)[0].shape[0]
    if num_layers % (s * r):
        raise ShardingError(f"{num_layers} stacked layers do not split into {s} pipeline "
                            f"stages x train.pipeline_repeats={r}; make model.num_layers a "
                            f"multiple of {s * r}")
    if x.shape[0] % m:
        raise ShardingError(f"batch of {x.shape[0]} rows does not split into "
                            f"train.microbatches={m}")
    if r > 1 and (m % s or stages.schedule.schedule != "gpipe"):
        raise ShardingError(f"train.pipeline_repeats={r} needs train.pipeline_schedule=gpipe "
                            f"and train.microbatches a multiple of the {s} stages")
    staged = jax.tree.map(lambda p: _on_stages(_stage_view(p, s, r), stages), state)
    xs = _split_microbatches(x, m)
    if stages.schedule.schedule == "1f1b":
        from spmd.sharding.one_f_one_b import one_f_one_b

        ys = one_f_one_b(block, staged, xs, stages)
    else:
        ys = gpipe_forward(block, staged, xs, stages)
    return _merge_microbatches(ys)


def _stage_view(p: jax.Array, s: int, r: int) -> jax.Array:
    """(L, ...) in layer order -> (S, L/S, ...), or (S, R, L/(S R), ...) for R repeats,
    where [k, j] is layer chunk j S + k. The stored parameters keep layer order (checkpoints
    do not depend on R), so for R > 1 XLA moves chunks between stages every step."""
    if r == 1:
        return p.reshape(s, p.shape[0] // s, *p.shape[1:])
    return p.reshape(r, s, p.shape[0] // (s * r), *p.shape[1:]).swapaxes(0, 1)


def stage_function(block: Block) -> Callable[[Any, jax.Array], jax.Array]:
    """One stage: its L/S layers in order, as a scan."""

    def stage(params: Any, h: jax.Array) -> jax.Array:
        def body(carry, layer_params):
            return block(layer_params, carry), None

        return jax.lax.scan(body, h, params)[0]

    return stage


def gpipe_forward(block: Block, staged: Any, xs: jax.Array, stages: _Stages) -> jax.Array:
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
        buf = _on_stages(jnp.where(_per_stage(fresh, buf), new[None], buf), stages)
        params = staged if r == 1 else pick(staged, repeat)
        out = _on_stages(run(params, buf), stages)
        result = out[s - 1]
        if r > 1:
            kept = jax.lax.dynamic_index_in_dim(outputs, item[s - 1], 0, keepdims=False)
            result = jnp.where(repeat[s - 1] == r - 1, result, kept)
        outputs = jax.lax.dynamic_update_index_in_dim(outputs, result, item[s - 1], 0)
        return (jnp.roll(out, 1, axis=0), outputs), None

    buf = _on_stages(jnp.zeros((s, *xs.shape[1:]), xs.dtype), stages)
    (_, outputs), _ = jax.lax.scan(tick, (buf, jnp.zeros_like(xs)),
                                   jnp.arange(r * m + s - 1))
    return outputs


def _per_stage(mask: jax.Array, x: jax.Array) -> jax.Array:
    """Broadcast a (S,) mask against an array whose leading dimension is the stage."""
    return mask.reshape(mask.shape + (1,) * (x.ndim - 1))
