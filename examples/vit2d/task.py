"""A small vision transformer learns the periodic 2-D Poisson operator f -> u, -lap u = f.

A user project: it imports only spmd's public API (`spmd`, `spmd.sharding`, `spmd.data`).
Patches of the 32x32 source field f become tokens (`length`), a few pre-norm transformer
blocks (annotated `embed`, `mlp`, `heads`) mix them globally, and each token's output is
the patch of u it covers. `make_data` writes the fields (random low-mode sources, solved
exactly by FFT) as an HDF5 file read through spmd's generic array source.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from pydantic import Field, model_validator

import spmd
from spmd.data import ArraySource, write_arrays
from spmd.sharding import constrain, with_axes

FIELD = ("batch", "x", "y", "channels")
TOKENS = ("batch", "length", "embed")
DATASETS = {"f": "{split}/f", "u": "{split}/u"}   # data.fields may override

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


def relative_l2(pred: jax.Array, truth: jax.Array) -> jax.Array:
    axes = tuple(range(1, truth.ndim))
    return jnp.sqrt(jnp.sum((pred - truth) ** 2, axes) / jnp.sum(truth**2, axes))


class ViTTask(spmd.Task):
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

    def batch_fields(self) -> dict[str, spmd.BatchField]:
        shape = (self.cfg.model.grid, self.cfg.model.grid, 1)
        return {name: spmd.BatchField(shape, np.float32, FIELD) for name in ("f", "u")}

    # ------------------------------------------------------------ data

    def make_data(self, *, workers: int = 1, force: bool = False, **options) -> str:
        """`spmd data make`: write data.path (train and test splits) if missing."""
        path, d, m = Path(self.cfg.data.path), self.cfg.data, self.cfg.model
        if path.exists() and not force:
            return f"{path} exists ({self.describe_data()})"
        arrays = {}
        for split, count, seed in (("train", d.num_train, d.seed), ("test", d.num_test,
                                                                     d.seed + 1)):
            arrays[f"{split}/f"], arrays[f"{split}/u"] = poisson_pairs(count, m.grid, m.modes,
                                                                       seed)
        write_arrays(path, arrays, {"problem": "2-D periodic Poisson", "grid": m.grid,
                                    "modes": m.modes, "seed": d.seed})
        return f"wrote {path}: {d.num_train} train and {d.num_test} test fields of {m.grid}^2"

    def describe_data(self) -> str:
        train = self._source("train", True)
        return f"{self.cfg.data.path}: {train.count} train fields, fields {train.datasets}"

    def prepare(self, is_coordinator: bool) -> None:
        if is_coordinator and not Path(self.cfg.data.path).exists():
            print(f"data.path {self.cfg.data.path} is missing: making it (spmd data make)")
            self.make_data()

    def _source(self, split: str, shuffle: bool) -> ArraySource:
        count = self.cfg.data.num_train if split == "train" else self.cfg.data.num_test
        return ArraySource.from_config(self.cfg, split, self.batch_fields(), DATASETS,
                                       shuffle=shuffle, count=count)

    def train_source(self) -> ArraySource:
        return self._source("train", shuffle=True)

    def eval_source(self) -> ArraySource | None:
        return self._source("test", shuffle=False) if self.cfg.train.eval_every else None

    # ------------------------------------------------------------ model

    def loss(self, model, batch):
        return jnp.mean((model(batch["f"]) - batch["u"]) ** 2), {}

    def eval_metrics(self, model, batch) -> dict:
        pred = model(batch["f"])
        return {"eval_loss": jnp.mean((pred - batch["u"]) ** 2),
                "test_rel_l2": jnp.mean(relative_l2(pred, batch["u"]))}

    def sample_outputs(self, model, batch) -> dict:
        pred = model(batch["f"])[..., 0]
        return {"input": batch["f"][..., 0], "truth": batch["u"][..., 0],
                "prediction": pred, "error": pred - batch["u"][..., 0]}

    def plot(self, out_dir, sample) -> list:
        from spmd.plots import plot_fields

        return [plot_fields(sample, Path(out_dir) / "samples.png",
                            title="Poisson: source f, solution u and the ViT's prediction")]
