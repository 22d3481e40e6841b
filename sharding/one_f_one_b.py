"""1F1B: the backward pass of the pipelined stack as an explicit one-forward-one-backward schedule.

The stack is wrapped in a `jax.custom_vjp`. Its forward rule is the GPipe forward
(`gpipe_forward`) and keeps only the stack's input microbatches as residuals (no per-layer
activations). Its backward rule runs M + 2S - 2 lockstep ticks; at tick t stage k
- recomputes the forward of microbatch t - k (input from stage k - 1, or the stack input
  for k = 0) and stashes that stage input in a ring of R = min(M, 2S - 1) slots;
- runs the backward (`jax.vjp` of the stage, recomputing its layers) of microbatch
  t - (2S - 2 - k), whose output cotangent came from stage k + 1 in the previous tick (or
  the stack's output cotangent for k = S - 1), accumulates the parameter gradient and
  sends the input cotangent to stage k - 1 (`jnp.roll` backwards: a collective-permute).
The first S - 1 ticks (warm-up) have no backward on any stage and the last S - 1
(cool-down) no forward, so a `lax.switch` on t (the same branch on every device) skips
them: each stage then spends M + S - 1 ticks on each kind of slot, M of them useful, and
the bubble is the textbook (S - 1) / (M + S - 1) (`pipeline.bubble_fraction`).

Invariants:
- Stage k holds at most 2(S - 1 - k) + 1 <= 2S - 1 stashed stage inputs at once, whatever
  M is (GPipe's autodiff keeps every layer's residuals for all M + S - 1 ticks); the ring
  size R makes a slot's next write come after its read.
- Gradients equal GPipe's (and the unpipelined scan's): each microbatch's cotangent goes
  through the same stage VJPs; invalid (bubble) slots are masked to zero before they are
  accumulated.

What this costs: the loss is outside the stack (the task computes it on the stack's
output), so the backward cannot start before the whole forward has run; the schedule
therefore runs each microbatch's stage forward three times (primal, stash, inside the VJP)
where a 1F1B with the loss on the last stage runs it once or twice. That is recompute, as
with remat, not bubble: a step is (M + S - 1) ticks of (3 f + b) against GPipe's (f + b).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from spmd.sharding.stages import Block, Stages, gpipe_forward, on_stages, per_stage, stage_function


def tick_phase(t: Any, stages: int, microbatches: int) -> Any:
    """0: warm-up (t < S - 1, no stage has a backward yet), 1: steady (both slots),
    2: cool-down (t >= M + S - 1, no stage has a forward left). Works on ints and tracers."""
    s, m = stages, microbatches
    return jnp.asarray(t >= s - 1, jnp.int32) + jnp.asarray(t >= m + s - 1, jnp.int32)


def one_f_one_b(block: Block, staged: Any, xs: jax.Array, stages: Stages) -> jax.Array:
    """(M, mb, ...) microbatches through the stages; 1F1B-scheduled backward."""

    @jax.custom_vjp
    def run(staged, xs):
        return gpipe_forward(block, staged, xs, stages)

    def fwd(staged, xs):
        return gpipe_forward(block, staged, xs, stages), (staged, xs)

    def bwd(residuals, gys):
        staged, xs = residuals
        return _backward(block, staged, xs, gys, stages)

    run.defvjp(fwd, bwd)
    return run(staged, xs)


def _backward(block: Block, staged: Any, xs: jax.Array, gys: jax.Array,
              stages: Stages) -> tuple[Any, jax.Array]:
    s, m = stages.count, xs.shape[0]
    ring = min(m, 2 * s - 1)
    k = jnp.arange(s)
    stage = stage_function(block)

    def stage_vjp(params, x, g):
        _, pull = jax.vjp(stage, params, x)
        return pull(g)

    forward = jax.vmap(stage, spmd_axis_name=stages.axes)
    backward = jax.vmap(stage_vjp, spmd_axis_name=stages.axes)
    write = jax.vmap(lambda ring_, v, i: jax.lax.dynamic_update_index_in_dim(ring_, v, i, 0))
    read = jax.vmap(lambda ring_, i: jax.lax.dynamic_index_in_dim(ring_, i, 0, keepdims=False))
    first, last = k == 0, k == s - 1

    def forward_slot(fbuf, stash, t):
        """Stage k runs microbatch t - k forward and stashes its input for the backward."""
        fi = t - k
        f_ok = (fi >= 0) & (fi < m)
        new = jax.lax.dynamic_index_in_dim(xs, jnp.clip(t, 0, m - 1), 0, keepdims=False)
        inp = on_stages(jnp.where(per_stage(first, fbuf), new[None], fbuf), stages)
        out = on_stages(forward(staged, inp), stages)
        slot = jnp.mod(jnp.clip(fi, 0, m - 1), ring)
        stash = write(stash, jnp.where(per_stage(f_ok, inp), inp, read(stash, slot)), slot)
        return jnp.roll(out, 1, axis=0), stash

    def backward_slot(gbuf, stash, grads, gxs, t):
        """Stage k runs the backward of microbatch t - (2S - 2 - k) and sends g_in down."""
        bi = t - (2 * s - 2 - k)
        b_ok = (bi >= 0) & (bi < m)
        g_last = jax.lax.dynamic_index_in_dim(gys, jnp.clip(t - (s - 1), 0, m - 1), 0,
                                              keepdims=False)
        g_out = on_stages(jnp.where(per_stage(last, gbuf), g_last[None], gbuf), stages)
        x_b = read(stash, jnp.mod(jnp.clip(bi, 0, m - 1), ring))
        g_params, g_in = backward(staged, x_b, g_out)
        grads = jax.tree.map(
            lambda acc, g: acc + jnp.where(per_stage(b_ok, g), g, 0), grads, g_params)
        g_in = jnp.where(per_stage(b_ok, g_in), g_in, 0)
        gxs = jax.lax.dynamic_update_index_in_dim(
            gxs, g_in[0], jnp.clip(t - (2 * s - 2), 0, m - 1), 0)
        return on_stages(jnp.roll(g_in, -1, axis=0), stages), grads, gxs

    def tick(carry, t):
        """One tick; which slots it runs is the same on every device (it depends on t only)."""

        def forward_only(fbuf, gbuf, stash, grads, gxs):
            fbuf, stash = forward_slot(fbuf, stash, t)
            return fbuf, gbuf, stash, grads, gxs

        def both(fbuf, gbuf, stash, grads, gxs):
            # forward first: the last stage's backward reads the input it stashes this tick
            fbuf, stash = forward_slot(fbuf, stash, t)
            gbuf, grads, gxs = backward_slot(gbuf, stash, grads, gxs, t)
            return fbuf, gbuf, stash, grads, gxs

        def backward_only(fbuf, gbuf, stash, grads, gxs):
            gbuf, grads, gxs = backward_slot(gbuf, stash, grads, gxs, t)
            return fbuf, gbuf, stash, grads, gxs

        branches = (forward_only, both, backward_only)
        return jax.lax.switch(tick_phase(t, s, m), branches, *carry), None

    zeros = on_stages(jnp.zeros((s, *xs.shape[1:]), xs.dtype), stages)
    stash = on_stages(jnp.zeros((s, ring, *xs.shape[1:]), xs.dtype), stages)
    grads = jax.tree.map(jnp.zeros_like, staged)
    carry = (zeros, zeros, stash, grads, jnp.zeros_like(xs))
    (_, _, _, grads, gxs), _ = jax.lax.scan(tick, carry, jnp.arange(m + 2 * s - 2))
    return grads, gxs
