"""A 3-D U-Net learns the heat-equation solution operator u(0) -> u(t) on a periodic 16^3 grid.

A user project: it imports only spmd's public API (`spmd`, `spmd.sharding`). As a
`spmd.FieldTask` it says only how to make its examples (random Gaussian blobs, diffused
exactly with an FFT); spmd writes them to data.path and reads them back through its generic
array source, which under `spatial` reads only each process's x/y slab. The model uses
logical axis names only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from pydantic import Field

import spmd
from spmd.sharding import constrain, with_axes

FIELD = ("batch", "x", "y", "z", "channels")


def _conv(cin: int, cout: int, axes: tuple[str, str], rngs: nnx.Rngs, kernel: int = 3,
          stride: int = 1, transpose: bool = False) -> nnx.Module:
    init, zeros = nnx.initializers.lecun_normal(), nnx.initializers.zeros_init()
    layer = nnx.ConvTranspose if transpose else nnx.Conv
    return layer(cin, cout, (kernel,) * 3, strides=stride, padding="SAME", rngs=rngs,
                 kernel_init=with_axes(init, (None, None, None, *axes)),
                 bias_init=with_axes(zeros, (axes[1],)))


class UNet3d(nnx.Module):
    """Two levels: 16^3 x w -> 8^3 x 2w -> 16^3 x w (skip connection) -> one channel."""

    def __init__(self, width: int, *, rngs: nnx.Rngs):
        w = width
        self.enc = _conv(1, w, ("channels", "embed"), rngs)
        self.down = _conv(w, 2 * w, ("embed", "mlp"), rngs, kernel=2, stride=2)
        self.mid = _conv(2 * w, 2 * w, ("mlp", "embed"), rngs)
        self.up = _conv(2 * w, w, ("embed", "mlp"), rngs, kernel=2, stride=2, transpose=True)
        self.dec = _conv(2 * w, w, ("mlp", "embed"), rngs)
        self.out = _conv(w, 1, ("embed", "channels"), rngs, kernel=1)

    def __call__(self, u: jax.Array) -> jax.Array:            # u: (batch, x, y, z, 1)
        u = constrain(u, FIELD)
        h1 = constrain(jax.nn.gelu(self.enc(u)), ("batch", "x", "y", "z", "embed"))
        h2 = constrain(jax.nn.gelu(self.down(h1)), ("batch", "x", "y", "z", "mlp"))
        h2 = constrain(jax.nn.gelu(self.mid(h2)), ("batch", "x", "y", "z", "embed"))
        up = constrain(jax.nn.gelu(self.up(h2)), ("batch", "x", "y", "z", "mlp"))
        h = jnp.concatenate([h1, up], axis=-1)
        h = constrain(jax.nn.gelu(self.dec(h)), ("batch", "x", "y", "z", "embed"))
        return constrain(self.out(h), FIELD)


def heat_pairs(count: int, grid: int, diffusion: float, seed: int) -> tuple[np.ndarray, ...]:
    """`count` random fields (4 periodic Gaussian blobs of amplitude +-1) and the same
    fields diffused for time 1 with coefficient `diffusion` (exact, by FFT)."""
    rng = np.random.default_rng(seed)
    x = np.arange(grid) / grid
    u0 = np.zeros((count, grid, grid, grid), np.float64)
    for _ in range(4):
        centre = rng.random((count, 3, 1))
        width = rng.uniform(0.08, 0.14, (count, 1, 1, 1))
        d = [np.minimum(abs(x - c), 1 - abs(x - c)) for c in centre.transpose(1, 0, 2)]
        r2 = d[0][:, :, None, None] ** 2 + d[1][:, None, :, None] ** 2 + d[2][:, None, None, :] ** 2
        u0 += rng.choice([-1.0, 1.0], (count, 1, 1, 1)) * np.exp(-r2 / (2 * width**2))
    k = np.fft.fftfreq(grid, 1 / grid) * 2 * np.pi
    k2 = k[:, None, None] ** 2 + k[None, :, None] ** 2 + k[None, None, :] ** 2
    u1 = np.fft.ifftn(np.fft.fftn(u0, axes=(1, 2, 3)) * np.exp(-diffusion * k2),
                      axes=(1, 2, 3)).real
    return u0.astype(np.float32), u1.astype(np.float32)


class UNetTask(spmd.FieldTask):
    input_name, target_name, field_axes = "u0", "u1", FIELD
    sample_title = "3-D heat step: middle z slice of test volumes"

    class Config(spmd.ModelConfig):
        width: int = Field(8, ge=1)
        grid: int = Field(16, ge=4, multiple_of=2)
        diffusion: float = Field(0.004, gt=0)   # heat-equation coefficient x time

    def build_model(self, rngs: nnx.Rngs) -> UNet3d:
        return UNet3d(self.cfg.model.width, rngs=rngs)

    def field_shape(self) -> tuple[int, ...]:
        return (self.cfg.model.grid,) * 3 + (1,)

    def make_pairs(self, count: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
        m = self.cfg.model
        u0, u1 = heat_pairs(count, m.grid, m.diffusion, seed)
        return u0[..., None], u1[..., None]

    def data_attrs(self) -> dict:
        m = self.cfg.model
        return {"problem": "3-D heat equation", "grid": m.grid, "diffusion": m.diffusion}
