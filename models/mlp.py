"""A residual MLP regressor: the smallest model that exercises every preset."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from spmd.models.layers import Dense, RMSNorm
from spmd.sharding import constrain


class MlpBlock(nnx.Module):
    def __init__(self, d_model: int, d_hidden: int, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 param_dtype=jnp.float32):
        self.norm = RMSNorm(d_model, rngs=rngs, param_dtype=param_dtype)
        self.up = Dense(d_model, d_hidden, ("embed", "mlp"), rngs=rngs, dtype=dtype,
                        param_dtype=param_dtype)
        self.down = Dense(d_hidden, d_model, ("mlp", "embed"), rngs=rngs, dtype=dtype,
                          param_dtype=param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:  # x: (batch, embed)
        h = constrain(jax.nn.gelu(self.up(self.norm(x))), ("batch", "mlp"), name="mlp/hidden")
        return x + self.down(h).astype(x.dtype)


class Mlp(nnx.Module):
    """`num_layers` residual blocks of width `d_in`, then a linear head to `d_out` channels."""

    def __init__(self, d_in: int, d_hidden: int, d_out: int, num_layers: int, *,
                 rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        self.blocks = nnx.List(
            [MlpBlock(d_in, d_hidden, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
             for _ in range(num_layers)]
        )
        self.head = Dense(d_in, d_out, ("embed", "channels"), rngs=rngs, dtype=dtype,
                          param_dtype=param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:  # x: (batch, embed)
        x = constrain(x, ("batch", "embed"), name="mlp/input")
        for block in self.blocks:
            x = block(x)
        return self.head(x)
