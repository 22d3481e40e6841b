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
  schedule (see `one_f_one_b`).

Modules: `stages` (what a stage is, and the GPipe forward both schedules run),
`one_f_one_b` (the 1F1B backward), this one (whether and how to pipeline). Imports point one
way: pipeline -> one_f_one_b -> stages.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator
from typing import Any

import jax

from spmd.sharding.annotate import current_binding
from spmd.sharding.errors import ShardingError
from spmd.sharding.one_f_one_b import one_f_one_b
from spmd.sharding.rules import RuleTable
from spmd.sharding.stages import Block, PipelineSchedule, Stages, gpipe_forward, on_stages

LAYERS = "layers"


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


def active_pipeline() -> Stages | None:
    """The bound pipeline, or None when no binding shards `layers` over more than one device."""
    binding = current_binding()
    if binding is None:
        return None
    shape = dict(binding.mesh.shape)
    axes = stage_axes(binding.rules, shape)
    if not axes:
        return None
    schedule = _SCHEDULE.get() or PipelineSchedule()
    return Stages(binding.mesh, axes, num_stages(binding.rules, shape), schedule)


def _split_microbatches(x: jax.Array, m: int) -> jax.Array:
    """(B, ...) -> (M, B/M, ...), row i into microbatch i % M (keeps the batch sharding)."""
    b = x.shape[0]
    return x.reshape(b // m, m, *x.shape[1:]).swapaxes(0, 1)


def _merge_microbatches(xs: jax.Array) -> jax.Array:
    m, mb = xs.shape[:2]
    return xs.swapaxes(0, 1).reshape(m * mb, *xs.shape[2:])


def run_pipeline(block: Block, state: Any, x: jax.Array, stages: Stages) -> jax.Array:
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
    staged = jax.tree.map(lambda p: on_stages(_stage_view(p, s, r), stages), state)
    xs = _split_microbatches(x, m)
    if stages.schedule.schedule == "1f1b":
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
