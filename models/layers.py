"""Small building blocks shared by the reference models (logical names only).

Mixed precision: every module stores its parameters in `param_dtype` (the master weights,
float32 by default) and computes in `dtype`, casting the parameters at use.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from spmd.sharding import param

default_init = nnx.initializers.lecun_normal()


class RMSNorm(nnx.Module):
    """Root-mean-square norm over the last (`embed`) dimension, computed in float32."""

    def __init__(self, dim: int, *, eps: float = 1e-6, rngs: nnx.Rngs,
                 param_dtype=jnp.float32):
        self.scale = param(rngs.params(), nnx.initializers.ones, (dim,), ("embed",),
                           dtype=param_dtype)
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * self.scale[...].astype(jnp.float32)).astype(x.dtype)


class Dense(nnx.Module):
    """y = x @ W over the last dimension, W annotated with (in_axis, out_axis)."""

    def __init__(self, d_in: int, d_out: int, axes: tuple[str, str], *, rngs: nnx.Rngs,
                 init=default_init, dtype=jnp.float32, param_dtype=jnp.float32):
        self.kernel = param(rngs.params(), init, (d_in, d_out), axes, dtype=param_dtype)
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.kernel[...].astype(self.dtype)
        return jnp.einsum("...i,io->...o", x.astype(self.dtype), kernel)
