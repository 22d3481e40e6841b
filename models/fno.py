"""Fourier Neural Operator in 2D (Li et al., 2021): lift, L Fourier layers, project.

Fields are (batch, x, y, channels). A Fourier layer adds a spectral convolution (keep the
lowest `modes` frequencies in x and y, mix channels with complex weights, transform
back) to a pointwise linear map, then applies GELU. Under a domain-decomposition rule
table x and y are split across devices; the FFTs then run over distributed axes and
the compiler inserts the transposes they need.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from sharding import constrain, param

FIELD = ("batch", "x", "y", None)          # physical fields: a few channels, never split
HIDDEN = ("batch", "x", "y", "channels")   # lifted fields: `width` channels


def _uniform(scale: float):
    def init(key, shape, dtype=jnp.float32):
        return scale * jax.random.uniform(key, shape, dtype)

    return init


class Pointwise(nnx.Module):
    """A per-grid-point linear map over channels, with bias (a 1x1 convolution)."""

    def __init__(self, d_in: int, d_out: int, *, rngs: nnx.Rngs, in_axis: str | None = None,
                 out_axis: str | None = "channels", dtype=jnp.float32):
        init = nnx.initializers.variance_scaling(1.0, "fan_in", "uniform")
        self.kernel = param(rngs.params(), init, (d_in, d_out), (in_axis, out_axis))
        bound = 1.0 / d_in**0.5
        self.bias = param(rngs.params(), lambda k, s: jax.random.uniform(k, s, jnp.float32,
                                                                         -bound, bound),
                          (d_out,), (out_axis,))
        self.dtype = dtype

    def __call__(self, h: jax.Array) -> jax.Array:
        y = jnp.einsum("...i,io->...o", h.astype(self.dtype), self.kernel[...].astype(self.dtype))
        return y + self.bias[...].astype(self.dtype)


class SpectralConv2d(nnx.Module):
    """Channel mixing of the lowest `modes` x `modes` Fourier coefficients (both x halves).

    Complex weights are stored as float32 real/imaginary pairs of shape
    (2 corners, in, out, modes_x, modes_y).
    """

    def __init__(self, d_in: int, d_out: int, modes: int, *, rngs: nnx.Rngs):
        shape = (2, d_in, d_out, modes, modes)
        axes = (None, None, "channels", "modes", None)
        init = _uniform(1.0 / (d_in * d_out))
        self.weight_real = param(rngs.params(), init, shape, axes)
        self.weight_imag = param(rngs.params(), init, shape, axes)
        self.modes = modes

    def __call__(self, h: jax.Array) -> jax.Array:  # h: (batch, x, y, channels), real
        _, gx, gy, _ = h.shape
        m = self.modes
        h_ft = jnp.fft.rfft2(h.astype(jnp.float32), axes=(1, 2))   # (b, gx, gy//2+1, c)
        w = jax.lax.complex(self.weight_real[...], self.weight_imag[...])
        low = jnp.einsum("bxyi,ioxy->bxyo", h_ft[:, :m, :m], w[0])
        high = jnp.einsum("bxyi,ioxy->bxyo", h_ft[:, gx - m:, :m], w[1])
        zeros_x = jnp.zeros((low.shape[0], gx - 2 * m, m, low.shape[-1]), low.dtype)
        out_ft = jnp.concatenate([low, zeros_x, high], axis=1)
        out_ft = jnp.pad(out_ft, ((0, 0), (0, 0), (0, gy // 2 + 1 - m), (0, 0)))
        return jnp.fft.irfft2(out_ft, s=(gx, gy), axes=(1, 2))


class FourierLayer(nnx.Module):
    def __init__(self, width: int, modes: int, *, activation: bool, rngs: nnx.Rngs, dtype):
        self.spectral = SpectralConv2d(width, width, modes, rngs=rngs)
        self.pointwise = Pointwise(width, width, rngs=rngs, dtype=dtype)
        self.activation = activation

    def __call__(self, h: jax.Array) -> jax.Array:
        h = self.spectral(h).astype(h.dtype) + self.pointwise(h).astype(h.dtype)
        return jax.nn.gelu(h) if self.activation else h


class FNO2d(nnx.Module):
    """(batch, x, y, in_channels) input fields -> (batch, x, y, out_channels) output fields.

    The grid coordinates (x, y) in [0, 1] are appended to the input channels, as in the paper.
    """

    def __init__(self, *, in_channels: int, out_channels: int, width: int, modes: int,
                 num_layers: int, projection: int, rngs: nnx.Rngs, dtype=jnp.float32):
        self.lift = Pointwise(in_channels + 2, width, rngs=rngs, dtype=dtype)
        self.layers = nnx.List([
            FourierLayer(width, modes, activation=i < num_layers - 1, rngs=rngs, dtype=dtype)
            for i in range(num_layers)
        ])
        self.project = Pointwise(width, projection, rngs=rngs, dtype=dtype)
        self.output = Pointwise(projection, out_channels, rngs=rngs, in_axis="channels",
                                out_axis=None, dtype=dtype)
        self.dtype = dtype

    def __call__(self, a: jax.Array) -> jax.Array:
        b, gx, gy, _ = a.shape
        coords = jnp.stack(jnp.meshgrid(jnp.linspace(0.0, 1.0, gx), jnp.linspace(0.0, 1.0, gy),
                                        indexing="ij"), axis=-1)
        coords = jnp.broadcast_to(coords[None], (b, gx, gy, 2)).astype(a.dtype)
        h = constrain(jnp.concatenate([a, coords], axis=-1), FIELD, name="fno/input")
        h = constrain(self.lift(h), HIDDEN, name="fno/lift")
        for i, layer in enumerate(self.layers):
            h = constrain(layer(h), HIDDEN, name=f"fno/layer{i}")
        h = constrain(jax.nn.gelu(self.project(h)), HIDDEN, name="fno/projection")
        return constrain(self.output(h).astype(jnp.float32), FIELD, name="fno/output")
