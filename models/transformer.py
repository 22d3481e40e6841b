"""Decoder-only Transformer LM: pre-norm, causal multi-head attention, rotary/learned positions.

Invariants:
- With `scan_layers` (the default) the blocks are one stacked module (parameters shaped
  (num_layers, ...), logical axes ('layers', ...)) run by `jax.lax.scan`; without it they
  are an `nnx.List` run by a Python loop. Both paths draw the same initial values from the
  same `Rngs` and compute the same function (see models/scan.py).
- `features(tokens)` is the final-normed hidden state (batch, length, embed) and
  `logits(h)` the output projection, so a loss can project chunk by chunk
  (models/losses.py) instead of materialising (batch, length, vocab) at once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from spmd.models.attention import Attention, Implementation, rotary
from spmd.models.layers import Dense, RMSNorm
from spmd.models.scan import Remat, layer_of, run_stacked, run_unrolled, stack_layers
from spmd.sharding import constrain, param

__all__ = ["ACT", "Attention", "DecoderBlock", "FeedForward", "TransformerLM", "rotary"]

ACT = ("batch", "length", "embed")


class FeedForward(nnx.Module):
    def __init__(self, d_model: int, d_ff: int, *, rngs: nnx.Rngs, dtype,
                 param_dtype=jnp.float32):
        self.up = Dense(d_model, d_ff, ("embed", "mlp"), rngs=rngs, dtype=dtype,
                        param_dtype=param_dtype)
        self.down = Dense(d_ff, d_model, ("mlp", "embed"), rngs=rngs, dtype=dtype,
                          param_dtype=param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = constrain(jax.nn.gelu(self.up(x)), ("batch", "length", "mlp"), name="mlp/hidden")
        return self.down(h)


class DecoderBlock(nnx.Module):
    def __init__(self, d_model, num_heads, d_ff, *, rotary: bool, rngs: nnx.Rngs, dtype,
                 attention: Implementation = "xla", param_dtype=jnp.float32):
        self.attn_norm = RMSNorm(d_model, rngs=rngs, param_dtype=param_dtype)
        self.attn = Attention(d_model, num_heads, rotary=rotary, rngs=rngs, dtype=dtype,
                              implementation=attention, param_dtype=param_dtype)
        self.mlp_norm = RMSNorm(d_model, rngs=rngs, param_dtype=param_dtype)
        self.mlp = FeedForward(d_model, d_ff, rngs=rngs, dtype=dtype, param_dtype=param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.attn_norm(x)).astype(x.dtype)
        x = constrain(x, ACT, name="block/residual")
        x = x + self.mlp(self.mlp_norm(x)).astype(x.dtype)
        return constrain(x, ACT, name="block/residual")


class TransformerLM(nnx.Module):
    """Token ids (batch, length) -> next-token logits (batch, length, vocab)."""

    def __init__(self, *, num_layers: int, d_model: int, num_heads: int, d_ff: int,
                 vocab_size: int, seq_len: int, positions: str = "rotary",
                 rngs: nnx.Rngs, dtype=jnp.float32, scan_layers: bool = True,
                 remat: Remat = "none", attention: Implementation = "xla",
                 param_dtype=jnp.float32):
        embed_init = nnx.initializers.normal(stddev=1.0)
        self.embedding = param(rngs.params(), embed_init, (vocab_size, d_model),
                               ("vocab", "embed"), dtype=param_dtype)
        self.position = (
            param(rngs.params(), nnx.initializers.normal(0.02), (seq_len, d_model),
                  ("length", "embed"), dtype=param_dtype)
            if positions == "learned" else None
        )
        blocks = [
            DecoderBlock(d_model, num_heads, d_ff, rotary=positions == "rotary", rngs=rngs,
                         dtype=dtype, attention=attention, param_dtype=param_dtype)
            for _ in range(num_layers)
        ]
        self.scan_layers = scan_layers
        self.remat = remat
        self.blocks = stack_layers(blocks) if scan_layers else nnx.List(blocks)
        self.final_norm = RMSNorm(d_model, rngs=rngs, param_dtype=param_dtype)
        self.unembed = Dense(d_model, vocab_size, ("embed", "vocab"), rngs=rngs, dtype=dtype,
                             param_dtype=param_dtype)

    def layer(self, index: int) -> nnx.Module:
        """Block `index` as an ordinary block, whichever way the blocks are stored."""
        return layer_of(self.blocks, index) if self.scan_layers else self.blocks[index]

    def embed(self, tokens: jax.Array) -> jax.Array:
        x = jnp.take(self.embedding[...], tokens, axis=0)
        if self.position is not None:
            x = x + self.position[...][None, : tokens.shape[1]]
        return constrain(x, ACT, name="embedding/output")

    def features(self, tokens: jax.Array) -> jax.Array:
        """(batch, length) token ids -> final-normed hidden states (batch, length, embed)."""
        x = self.embed(tokens)
        if self.scan_layers:
            x = run_stacked(self.blocks, x, self.remat)
        else:
            x = run_unrolled(list(self.blocks), x, self.remat)
        return self.final_norm(x)

    def logits(self, h: jax.Array) -> jax.Array:
        """Hidden states (..., length, embed) -> logits (..., length, vocab) in the model dtype."""
        return constrain(self.unembed(h), ("batch", "length", "vocab"), name="logits")

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return self.logits(self.features(tokens))
