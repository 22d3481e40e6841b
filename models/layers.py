"""Small building blocks shared by the reference models (logical names only)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from spmd.sharding import param

default_init = nnx.initializers.lecun_normal()


class RMSNorm(nnx.Module):
    """Root-mean-square norm over the last (`embed`) dimension, computed in float32."""

    def __init__(self, dim: int, *, eps: float = 1e-6, rngs: nnx.Rngs):
        self.scale = param(rngs.params(), nnx.initializers.ones, (dim,), ("embed",))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * self.scale[...]).astype(x.dtype)


class Dense(nnx.Module):
    """y = x @ W over the last dimension, W annotated with (in_axis, out_axis)."""

    def __init__(self, d_in: int, d_out: int, axes: tuple[str, str], *, rngs: nnx.Rngs,
                 init=default_init, dtype=jnp.float32):
        self.kernel = param(rngs.params(), init, (d_in, d_out), axes)
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.kernel[...].astype(self.dtype)
        return jnp.einsum("...i,io->...o", x.astype(self.dtype), kernel)
