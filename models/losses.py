"""Next-token cross-entropy that never holds float32 logits for the whole batch.

`cross_entropy(logits_fn, hidden, targets, chunk)` splits the sequence into
`length / chunk` strided chunks (chunk c holds positions c, c + n, c + 2n, ... with
n = length / chunk), so the `length` dimension that remains keeps the sharding the rules
gave it (e.g. `context` under the sp preset). A `jax.lax.scan` projects one chunk at a
time, and `jax.checkpoint` makes the backward recompute that chunk's logits instead of
keeping them: at most (batch, chunk, vocab) float32 logits are alive at once.

Invariant: the result equals the plain loss (mean over every token) up to float32
summation order; `chunk <= 0` or `chunk >= length` is the plain loss.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax


def _sums(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    logits = logits.astype(jnp.float32)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    correct = (jnp.argmax(logits, -1) == targets).astype(jnp.float32)
    return jnp.sum(losses), jnp.sum(correct)


def cross_entropy(logits_fn: Callable[[jax.Array], jax.Array], hidden: jax.Array,
                  targets: jax.Array, chunk: int = 0) -> tuple[jax.Array, jax.Array]:
    """(mean loss, accuracy) of next-token prediction; hidden (batch, length, embed)."""
    batch, length = targets.shape
    count = batch * length
    if chunk <= 0 or chunk >= length:
        loss, correct = _sums(logits_fn(hidden), targets)
        return loss / count, correct / count
    if length % chunk:
        raise ValueError(f"loss chunk {chunk} does not divide the sequence length {length}")
    n = length // chunk
    h = jnp.moveaxis(hidden.reshape(batch, chunk, n, hidden.shape[-1]), 2, 0)
    t = jnp.moveaxis(targets.reshape(batch, chunk, n), 2, 0)

    @jax.checkpoint
    def one(h_c, t_c):
        return _sums(logits_fn(h_c), t_c)

    def body(carry, xs):
        loss, correct = one(*xs)
        return (carry[0] + loss, carry[1] + correct), None

    zero = jnp.zeros((), jnp.float32)
    (loss, correct), _ = jax.lax.scan(body, (zero, zero), (h, t))
    return loss / count, correct / count
