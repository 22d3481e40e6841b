"""A small vision transformer learns the periodic 2-D Poisson operator f -> u, -lap u = f.

A user project: it imports only spmd's public API (`spmd`, `spmd.sharding`).
Patches of the 32x32 source field f become tokens (`length`), a few pre-norm transformer
blocks (annotated `embed`, `mlp`, `heads`) mix them globally, and each token's output is
the patch of u it covers. As a `spmd.FieldTask` it only says how to make examples (random
low-mode sources, solved exactly by FFT); spmd writes them to an HDF5 file and reads them
back through its generic array source.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from pydantic import Field, model_validator

import spmd
from spmd.sharding import constrain, with_axes

FIELD = ("batch", "x", "y", "channels")
TOKENS = ("batch", "length", "embed")

_init, _zeros, _ones = (nnx.initializers.lecun_normal(), nnx.initializers.zeros_init(),
                        nnx.initializers.ones_init())


def _linear(cin, cout, axes, rngs: nnx.Rngs, **kw) -> nnx.LinearGeneral:
    return nnx.LinearGeneral(cin, cout, rngs=rngs, kernel_init=with_axes(_init, axes),
                             bias_init=with_axes(_zeros, axes[len(np.atleast_1d(cin)):]), **kw)


def _norm(d: int, rngs: nnx.Rngs) -> nnx.LayerNorm:
    return nnx.LayerNorm(d, rngs=rngs, scale_init=with_axes(_ones, ("embed",)),
                         bias_init=with_axes(_zeros, ("embed",)))


class Block(nnx.Module):
    """Pre-norm self-attention and MLP, each with a residual connection."""

    def __init__(self, d: int, heads: int, d_mlp: int, *, rngs: nnx.Rngs):
        self.heads, hd = heads, d // heads
        self.norm1, self.norm2 = _norm(d, rngs), _norm(d, rngs)
        self.qkv = _linear(d, (3, heads, hd), ("embed", None, "heads", None), rngs)
        self.proj = _linear((heads, hd), d, ("heads", None, "embed"), rngs, axis=(-2, -1))
        self.up = _linear(d, d_mlp, ("embed", "mlp"), rngs)
        self.down = _linear(d_mlp, d, ("mlp", "embed"), rngs)

    def __call__(self, x: jax.Array) -> jax.Array:           # x: (batch, length, embed)
        q, k, v = jnp.moveaxis(self.qkv(self.norm1(x)), 2, 0)  # each (batch, length, heads, hd)
        q = constrain(q, ("batch", "length", "heads", None))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
        mixed = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
        x = constrain(x + self.proj(mixed), TOKENS)
        h = constrain(jax.nn.gelu(self.up(self.norm2(x))), ("batch", "length", "mlp"))
        return constrain(x + self.down(h), TOKENS)


class ViT2d(nnx.Module):
    def __init__(self, grid: int, patch: int, d: int, heads: int, d_mlp: int, depth: int,
                 *, rngs: nnx.Rngs):
        self.grid, self.patch = grid, patch
        tokens = (grid // patch) ** 2
        self.embed = _linear(patch * patch, d, (None, "embed"), rngs)
        self.position = nnx.Param(with_axes(nnx.initializers.normal(0.02), ("length", "embed"))(
            rngs.params(), (tokens, d)))
        self.blocks = nnx.List([Block(d, heads, d_mlp, rngs=rngs) for _ in range(depth)])
        self.norm = _norm(d, rngs)
        self.head = _linear(d, patch * patch, ("embed", None), rngs)

    def __call__(self, f: jax.Array) -> jax.Array:           # f: (batch, x, y, 1)
        b, n, p = f.shape[0], self.grid // self.patch, self.patch
        f = constrain(f, FIELD)
        patches = f.reshape(b, n, p, n, p).transpose(0, 1, 3, 2, 4).reshape(b, n * n, p * p)
        x = constrain(self.embed(patches) + self.position[...], TOKENS)
        for block in self.blocks:
            x = block(x)
        out = self.head(self.norm(x)).reshape(b, n, n, p, p).transpose(0, 1, 3, 2, 4)
        return constrain(out.reshape(b, n * p, n * p, 1), FIELD)


def poisson_pairs(count: int, grid: int, modes: int, seed: int) -> tuple[np.ndarray, ...]:
    """Random sources f with Fourier modes |k| <= `modes` (zero mean) and the solutions u of
    -lap u = f on the periodic unit square, scaled by (2 pi)^2 so both are of order one."""
    rng = np.random.default_rng(seed)
    k = np.fft.fftfreq(grid, 1 / grid)
    kx, ky = np.meshgrid(k, k, indexing="ij")
    k2 = kx**2 + ky**2
    keep = (k2 > 0) & (k2 <= modes**2)
    coeff = rng.standard_normal((count, grid, grid)) + 1j * rng.standard_normal((count, grid,
                                                                                   grid))
    f_hat = np.where(keep, coeff, 0)
    f = np.fft.ifft2(f_hat).real
    f /= f.std(axis=(1, 2), keepdims=True)
    u = np.fft.ifft2(np.fft.fft2(f) * np.where(keep, 1.0 / np.maximum(k2, 1), 0)).real
    return f.astype(np.float32), (4.0 * u).astype(np.float32)


class ViTTask(spmd.FieldTask):
    input_name, target_name, field_axes = "f", "u", FIELD
    sample_title = "Poisson: source f, solution u and the ViT's prediction"

    class Config(spmd.ModelConfig):
        grid: int = Field(32, ge=4)
        patch: int = Field(4, ge=1)
        embed: int = Field(64, ge=1)
        heads: int = Field(4, ge=1)
        mlp: int = Field(128, ge=1)
        depth: int = Field(2, ge=1)
        modes: int = Field(2, ge=1)      # of the generated sources

        @model_validator(mode="after")
        def _fits(self):
            if self.grid % self.patch or self.embed % self.heads:
                raise ValueError(f"grid={self.grid} must be a multiple of patch={self.patch} "
                                 f"and embed={self.embed} of heads={self.heads}")
            return self

    def build_model(self, rngs: nnx.Rngs) -> ViT2d:
        m = self.cfg.model
        return ViT2d(m.grid, m.patch, m.embed, m.heads, m.mlp, m.depth, rngs=rngs)

    def field_shape(self) -> tuple[int, ...]:
        return (self.cfg.model.grid, self.cfg.model.grid, 1)

    def make_pairs(self, count: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
        m = self.cfg.model
        f, u = poisson_pairs(count, m.grid, m.modes, seed)
        return f[..., None], u[..., None]

    def data_attrs(self) -> dict:
        m = self.cfg.model
        return {"problem": "2-D periodic Poisson", "grid": m.grid, "modes": m.modes}
