"""Decoder-only Transformer LM: pre-norm, causal multi-head attention, rotary/learned positions."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from spmd.models.layers import Dense, RMSNorm, default_init
from spmd.sharding import constrain, param

ACT = ("batch", "length", "embed")


def rotary(x: jax.Array, positions: jax.Array, base: float = 10_000.0) -> jax.Array:
    """Rotate pairs of the head dimension by position-dependent angles (RoPE)."""
    half = x.shape[-1] // 2
    freqs = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions[:, None].astype(jnp.float32) * freqs[None, :]  # (length, half)
    sin, cos = jnp.sin(angles)[None, :, None, :], jnp.cos(angles)[None, :, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, d_model: int, num_heads: int, *, rotary: bool, rngs: nnx.Rngs, dtype):
        head_dim = d_model // num_heads
        qkv = ("embed", "heads", "kv")
        self.query = param(rngs.params(), default_init, (d_model, num_heads, head_dim), qkv)
        self.key = param(rngs.params(), default_init, (d_model, num_heads, head_dim), qkv)
        self.value = param(rngs.params(), default_init, (d_model, num_heads, head_dim), qkv)
        self.out = param(rngs.params(), default_init, (num_heads, head_dim, d_model),
                         ("heads", "kv", "embed"))
        self.rotary = rotary
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:  # x: (batch, length, embed)
        def project(w):
            y = jnp.einsum("ble,ehd->blhd", x.astype(self.dtype), w[...].astype(self.dtype))
            return constrain(y, ("batch", "length", "heads", "kv"), name="attention/qkv")

        q, k, v = project(self.query), project(self.key), project(self.value)
        if self.rotary:
            positions = jnp.arange(x.shape[1])
            q, k = rotary(q, positions), rotary(k, positions)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / jnp.sqrt(q.shape[-1])
        causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), dtype=bool))
        scores = jnp.where(causal[None, None], scores, jnp.finfo(jnp.float32).min)
        weights = jax.nn.softmax(scores, axis=-1).astype(self.dtype)
        context = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
        context = constrain(context, ("batch", "length", "heads", "kv"), name="attention/context")
        return jnp.einsum("blhd,hde->ble", context, self.out[...].astype(self.dtype))


class FeedForward(nnx.Module):
    def __init__(self, d_model: int, d_ff: int, *, rngs: nnx.Rngs, dtype):
        self.up = Dense(d_model, d_ff, ("embed", "mlp"), rngs=rngs, dtype=dtype)
        self.down = Dense(d_ff, d_model, ("mlp", "embed"), rngs=rngs, dtype=dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = constrain(jax.nn.gelu(self.up(x)), ("batch", "length", "mlp"), name="mlp/hidden")
        return self.down(h)


class DecoderBlock(nnx.Module):
    def __init__(self, d_model, num_heads, d_ff, *, rotary: bool, rngs: nnx.Rngs, dtype):
        self.attn_norm = RMSNorm(d_model, rngs=rngs)
        self.attn = Attention(d_model, num_heads, rotary=rotary, rngs=rngs, dtype=dtype)
        self.mlp_norm = RMSNorm(d_model, rngs=rngs)
        self.mlp = FeedForward(d_model, d_ff, rngs=rngs, dtype=dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.attn_norm(x)).astype(x.dtype)
        x = constrain(x, ACT, name="block/residual")
        x = x + self.mlp(self.mlp_norm(x)).astype(x.dtype)
        return constrain(x, ACT, name="block/residual")


class TransformerLM(nnx.Module):
    """Token ids (batch, length) -> next-token logits (batch, length, vocab)."""

    def __init__(self, *, num_layers: int, d_model: int, num_heads: int, d_ff: int,
                 vocab_size: int, seq_len: int, positions: str = "rotary",
                 rngs: nnx.Rngs, dtype=jnp.float32):
        embed_init = nnx.initializers.normal(stddev=1.0)
        self.embedding = param(rngs.params(), embed_init, (vocab_size, d_model), ("vocab", "embed"))
        self.position = (
            param(rngs.params(), nnx.initializers.normal(0.02), (seq_len, d_model),
                  ("length", "embed"))
            if positions == "learned" else None
        )
        self.blocks = nnx.List([
            DecoderBlock(d_model, num_heads, d_ff, rotary=positions == "rotary", rngs=rngs,
                         dtype=dtype)
            for _ in range(num_layers)
        ])
        self.final_norm = RMSNorm(d_model, rngs=rngs)
        self.unembed = Dense(d_model, vocab_size, ("embed", "vocab"), rngs=rngs, dtype=dtype)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = jnp.take(self.embedding[...], tokens, axis=0)
        if self.position is not None:
            x = x + self.position[...][None, : tokens.shape[1]]
        x = constrain(x, ACT, name="embedding/output")
        for block in self.blocks:
            x = block(x)
        logits = self.unembed(self.final_norm(x))
        return constrain(logits, ("batch", "length", "vocab"), name="logits")
