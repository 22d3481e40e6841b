"""A 3-D U-Net learns the heat-equation solution operator u(0) -> u(t) on a periodic 16^3 grid.

A user project: it imports only spmd's public API (`spmd`, `spmd.sharding`, `spmd.data`).
Its `make_data` writes the volumetric dataset itself (random Gaussian blobs, diffused exactly
with an FFT), and it reads the data through spmd's generic array source, which under
`spatial` reads only each process's x/y slab. The model uses logical axis names only.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from pydantic import Field

import spmd
from spmd.data import ArraySource, write_arrays
from spmd.sharding import constrain, with_axes

FIELD = ("batch", "x", "y", "z", "channels")
DATASETS = {"u0": "{split}/u0", "u1": "{split}/u1"}   # data.fields may override


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


def relative_l2(pred: jax.Array, truth: jax.Array) -> jax.Array:
    axes = tuple(range(1, truth.ndim))
    return jnp.sqrt(jnp.sum((pred - truth) ** 2, axes) / jnp.sum(truth**2, axes))


class UNetTask(spmd.Task):
    class Config(spmd.ModelConfig):
        width: int = Field(8, ge=1)
        grid: int = Field(16, ge=4, multiple_of=2)
        diffusion: float = Field(0.004, gt=0)   # heat-equation coefficient x time

    def build_model(self, rngs: nnx.Rngs) -> UNet3d:
        return UNet3d(self.cfg.model.width, rngs=rngs)

    def batch_fields(self) -> dict[str, spmd.BatchField]:
        shape = (self.cfg.model.grid,) * 3 + (1,)
        return {name: spmd.BatchField(shape, np.float32, FIELD) for name in ("u0", "u1")}

    # ------------------------------------------------------------ data

    def make_data(self, *, workers: int = 1, force: bool = False, **options) -> str:
        """`spmd data make`: write data.path (train and test splits) if missing."""
        path, d, m = Path(self.cfg.data.path), self.cfg.data, self.cfg.model
        if path.exists() and not force:
            return f"{path} exists ({self.describe_data()})"
        arrays = {}
        for split, count, seed in (("train", d.num_train, d.seed), ("test", d.num_test,
                                                                     d.seed + 1)):
            arrays[f"{split}/u0"], arrays[f"{split}/u1"] = heat_pairs(count, m.grid,
                                                                      m.diffusion, seed)
        write_arrays(path, arrays, {"problem": "3-D heat equation", "grid": m.grid,
                                    "diffusion": m.diffusion, "seed": d.seed})
        return f"wrote {path}: {d.num_train} train and {d.num_test} test volumes of {m.grid}^3"

    def describe_data(self) -> str:
        train = self._source("train", True)
        return f"{self.cfg.data.path}: {train.count} train volumes, fields {train.datasets}"

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
        return jnp.mean((model(batch["u0"]) - batch["u1"]) ** 2), {}

    def eval_metrics(self, model, batch) -> dict:
        pred = model(batch["u0"])
        return {"eval_loss": jnp.mean((pred - batch["u1"]) ** 2),
                "test_rel_l2": jnp.mean(relative_l2(pred, batch["u1"]))}

    def sample_outputs(self, model, batch) -> dict:
        pred = model(batch["u0"])[..., 0]
        return {"input": batch["u0"][..., 0], "truth": batch["u1"][..., 0],
                "prediction": pred, "error": pred - batch["u1"][..., 0]}

    def plot(self, out_dir, sample) -> list:
        from spmd.plots import plot_fields

        return [plot_fields(sample, Path(out_dir) / "samples.png",
                            title="3-D heat step: middle z slice of test volumes")]
