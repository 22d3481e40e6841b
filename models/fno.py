"""Fourier Neural Operator in 2D (Li et al., 2021): lift, L Fourier layers, project.

Fields are (batch, x, y, channels). A Fourier layer adds a spectral convolution (keep the
lowest `modes` frequencies in x and y, mix channels with complex weights, transform
back) to a pointwise linear map, then applies GELU.

The truncated transforms are written as contractions with small DFT matrices rather
than FFTs: only 2*modes x modes coefficients are ever kept, so this costs about what an
FFT does here, and XLA partitions a contraction like any other. Batch-parallel runs need
no communication, and a grid split across devices (domain decomposition) all-reduces
only the small mode tensor; XLA's FFT partitioning instead gathers whole fields.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from spmd.sharding import constrain, param

FIELD = ("batch", "x", "y", None)          # physical fields: a few channels, never split
HIDDEN = ("batch", "x", "y", "channels")   # lifted fields: `width` channels


def _uniform(scale: float):
    def init(key, shape, dtype=jnp.float32):   # drawn in float32, then stored in `dtype`
        return (scale * jax.random.uniform(key, shape, jnp.float32)).astype(dtype)

    return init


class Pointwise(nnx.Module):
    """A per-grid-point linear map over channels, with bias (a 1x1 convolution)."""

    def __init__(self, d_in: int, d_out: int, *, rngs: nnx.Rngs, in_axis: str | None = None,
                 out_axis: str | None = "channels", dtype=jnp.float32,
                 param_dtype=jnp.float32):
        init = nnx.initializers.variance_scaling(1.0, "fan_in", "uniform")
        self.kernel = param(rngs.params(), init, (d_in, d_out), (in_axis, out_axis),
                            dtype=param_dtype)
        bound = 1.0 / d_in**0.5
        self.bias = param(rngs.params(), lambda k, s, dtype: jax.random.uniform(
            k, s, jnp.float32, -bound, bound).astype(dtype), (d_out,), (out_axis,),
            dtype=param_dtype)
        self.dtype = dtype

    def __call__(self, h: jax.Array) -> jax.Array:
        y = jnp.einsum("...i,io->...o", h.astype(self.dtype), self.kernel[...].astype(self.dtype))
        return y + self.bias[...].astype(self.dtype)


class SpectralConv2d(nnx.Module):
    """Channel mixing of the lowest `modes` x `modes` Fourier coefficients (both x halves).

    Complex weights are stored as float32 real/imaginary pairs of shape
    (2 corners, in, out, modes_x, modes_y).
    """

    def __init__(self, d_in: int, d_out: int, modes: int, *, rngs: nnx.Rngs,
                 param_dtype=jnp.float32):
        shape = (2, d_in, d_out, modes, modes)
        axes = (None, None, "channels", "modes", None)
        init = _uniform(1.0 / (d_in * d_out))
        self.weight_real = param(rngs.params(), init, shape, axes, dtype=param_dtype)
        self.weight_imag = param(rngs.params(), init, shape, axes, dtype=param_dtype)
        self.modes = modes

    def __call__(self, h: jax.Array) -> jax.Array:  # h: (batch, x, y, channels), real
        _, gx, gy, _ = h.shape
        m = self.modes
        fy, fx, ix, iy = dft_matrices(gx, gy, m)
        w = jax.lax.complex(self.weight_real[...].astype(jnp.float32),
                            self.weight_imag[...].astype(jnp.float32))
        w = jnp.concatenate([w[0], w[1]], axis=2)                # (in, out, 2m, m): both x halves
        h = h.astype(jnp.float32)
        # The field is real, so y -> ky is one real product giving the real and the imaginary
        # parts side by side (half the work of a complex product), and so is ky -> y, which
        # keeps only the real part.
        h_ft = jnp.einsum("bxyc,ky->bxkc", h, fy)                 # y -> ky (rfft, kept modes)
        h_ft = jax.lax.complex(h_ft[:, :, :m], h_ft[:, :, m:])
        h_ft = jnp.einsum("bxkc,jx->bjkc", h_ft, fx)              # x -> kx (both halves)
        out_ft = jnp.einsum("bjki,iojk->bjko", h_ft, w)           # channel mixing per mode
        out = jnp.einsum("bjko,xj->bxko", out_ft, ix)             # kx -> x
        out = jnp.concatenate([out.real, out.imag], axis=2)
        return jnp.einsum("bxko,yk->bxyo", out, iy)               # ky -> y (Hermitian sum)


def dft_matrices(gx: int, gy: int, modes: int) -> tuple[jax.Array, ...]:
    """(fy, fx, ix, iy): the DFT matrices restricted to the kept modes, as constants.

    fx (2m, gx, complex) keeps kx in [0, m) and [gx - m, gx), ix (gx, 2m) is its inverse.
    Over y, whose input and output are real, the matrices are real: fy (2m, gy) stacks the
    real part of the forward transform for ky in [0, m) above its imaginary part, and iy
    (gy, 2m) holds the real and the negated imaginary part of the inverse, which carries the
    Hermitian weights of an inverse real FFT (1 for ky = 0 and Nyquist, 2 otherwise). With
    the 1/(gx*gy) normalization the result equals irfft2 of the zero-padded spectrum.
    """
    kx = np.concatenate([np.arange(modes), np.arange(gx - modes, gx)])
    ky = np.arange(modes)
    x, y = np.arange(gx), np.arange(gy)
    fx = np.exp(-2j * np.pi * (np.outer(kx, x) % gx) / gx)
    fy = np.exp(-2j * np.pi * (np.outer(ky, y) % gy) / gy)
    hermitian = np.where((ky == 0) | (2 * ky == gy), 1.0, 2.0)
    ix = np.conj(fx).T / gx                                       # (gx, 2m)
    iy = (np.conj(fy) * hermitian[:, None]).T / gy                # (gy, m)
    fy_real = np.concatenate([fy.real, fy.imag], axis=0)          # (2m, gy)
    iy_real = np.concatenate([iy.real, -iy.imag], axis=1)         # (gy, 2m)
    return (jnp.asarray(fy_real, jnp.float32), jnp.asarray(fx, jnp.complex64),
            jnp.asarray(ix, jnp.complex64), jnp.asarray(iy_real, jnp.float32))


class FourierLayer(nnx.Module):
    def __init__(self, width: int, modes: int, *, activation: bool, rngs: nnx.Rngs, dtype,
                 param_dtype=jnp.float32):
        self.spectral = SpectralConv2d(width, width, modes, rngs=rngs, param_dtype=param_dtype)
        self.pointwise = Pointwise(width, width, rngs=rngs, dtype=dtype,
                                   param_dtype=param_dtype)
        self.activation = activation

    def __call__(self, h: jax.Array) -> jax.Array:
        h = self.spectral(h).astype(h.dtype) + self.pointwise(h).astype(h.dtype)
        return jax.nn.gelu(h) if self.activation else h


class FNO2d(nnx.Module):
    """(batch, x, y, in_channels) input fields -> (batch, x, y, out_channels) output fields.

    The grid coordinates (x, y) in [0, 1] are appended to the input channels, as in the paper.
    """

    def __init__(self, *, in_channels: int, out_channels: int, width: int, modes: int,
                 num_layers: int, projection: int, rngs: nnx.Rngs, dtype=jnp.float32,
                 param_dtype=jnp.float32):
        pd = {"dtype": dtype, "param_dtype": param_dtype}
        self.lift = Pointwise(in_channels + 2, width, rngs=rngs, **pd)
        self.layers = nnx.List([
            FourierLayer(width, modes, activation=i < num_layers - 1, rngs=rngs, **pd)
            for i in range(num_layers)
        ])
        self.project = Pointwise(width, projection, rngs=rngs, **pd)
        self.output = Pointwise(projection, out_channels, rngs=rngs, in_axis="channels",
                                out_axis=None, **pd)
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
