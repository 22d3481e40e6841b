"""Causal multi-head self-attention: projections, RoPE, and the attention kernel choice.

Invariants:
- Activations are (batch, length, heads, kv) with logical names only; `heads` and `length`
  are whatever the rule table says (tensor / context in the tp and sp presets).
- `implementation` is concrete here ("xla" or "cudnn"): the task resolves `auto` and checks
  that cuDNN is possible before the model is built, so the model never guesses.
- The attention output (before the output projection) is named `ATTENTION_OUT` with
  `checkpoint_name`, so the `save_attention` remat policy can keep exactly it.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from spmd.models.layers import default_init
from spmd.sharding import constrain, param

ATTENTION_OUT = "attention_out"
Implementation = Literal["xla", "cudnn"]
HEADS = ("batch", "length", "heads", "kv")


def rotary(x: jax.Array, positions: jax.Array, base: float = 10_000.0) -> jax.Array:
    """Rotate pairs of the head dimension by position-dependent angles (RoPE)."""
    half = x.shape[-1] // 2
    freqs = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions[:, None].astype(jnp.float32) * freqs[None, :]  # (length, half)
    sin, cos = jnp.sin(angles)[None, :, None, :], jnp.cos(angles)[None, :, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(x.dtype)


def einsum_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """The hand-written causal attention (scores materialised in float32): the reference."""
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / jnp.sqrt(q.shape[-1])
    length = q.shape[1]
    causal = jnp.tril(jnp.ones((length, length), dtype=bool))
    scores = jnp.where(causal[None, None], scores, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                     implementation: Implementation) -> jax.Array:
    """softmax(q k^T / sqrt(d), causal) v on (batch, length, heads, kv) arrays.

    "cudnn" is cuDNN's fused flash attention (NVIDIA GPUs, bf16); "xla" is JAX's
    reference lowering, which runs everywhere.
    """
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)


class Attention(nnx.Module):
    def __init__(self, d_model: int, num_heads: int, *, rotary: bool, rngs: nnx.Rngs, dtype,
                 implementation: Implementation = "xla", param_dtype=jnp.float32):
        head_dim = d_model // num_heads
        qkv = ("embed", "heads", "kv")
        shape = (d_model, num_heads, head_dim)
        self.query = param(rngs.params(), default_init, shape, qkv, dtype=param_dtype)
        self.key = param(rngs.params(), default_init, shape, qkv, dtype=param_dtype)
        self.value = param(rngs.params(), default_init, shape, qkv, dtype=param_dtype)
        self.out = param(rngs.params(), default_init, (num_heads, head_dim, d_model),
                         ("heads", "kv", "embed"), dtype=param_dtype)
        self.rotary = rotary
        self.dtype = dtype
        self.implementation = implementation

    def __call__(self, x: jax.Array) -> jax.Array:  # x: (batch, length, embed)
        def project(w):
            y = jnp.einsum("ble,ehd->blhd", x.astype(self.dtype), w[...].astype(self.dtype))
            return constrain(y, HEADS, name="attention/qkv")

        q, k, v = project(self.query), project(self.key), project(self.value)
        if self.rotary:
            positions = jnp.arange(x.shape[1])
            q, k = rotary(q, positions), rotary(k, positions)
        context = causal_attention(q, k, v, self.implementation)
        context = constrain(context, HEADS, name="attention/context")
        context = checkpoint_name(context, ATTENTION_OUT)
        return jnp.einsum("blhd,hde->ble", context, self.out[...].astype(self.dtype))
