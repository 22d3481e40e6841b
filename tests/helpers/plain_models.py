"""Models written as people write them, with no spmd in them (issue 36).

`PlainConvTask`: a 2-D conv net in plain Flax NNX (three `nnx.Conv`, a 1-channel output) with
no sharding annotations at all: no `with_axes`, no `nnx.with_partitioning`.
`AttentionTask`: Flax's own `nnx.MultiHeadAttention` built with `decode=None`, which raises
"No 'decode' argument was provided" unless a mode hook sets it; `DecodeModeTask` sets it in
`train_mode`/`eval_mode`. `RaisingTask`: the conv net with a middle layer whose `__call__`
raises (for the framed error).

    task: tests.helpers.plain_models:PlainConvTask
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import spmd

FIELD = ("batch", "x", "y", None)


class PlainConvNet(nnx.Module):
    def __init__(self, width: int, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, width, (3, 3), padding="SAME", rngs=rngs)
        self.conv2 = nnx.Conv(width, width, (3, 3), padding="SAME", rngs=rngs)
        self.conv3 = nnx.Conv(width, 1, (3, 3), padding="SAME", rngs=rngs)

    def __call__(self, u):
        h = jax.nn.gelu(self.conv1(u))
        h = jax.nn.gelu(self.conv2(h))
        return u + self.conv3(h)


class DiffusionSource:
    """u0: noise on a grid x grid field; u1: one explicit diffusion step of it."""

    def __init__(self, seed: int, grid: int):
        self.seed, self.grid = seed, grid

    def rows(self, step, start, stop):
        u = np.stack([np.random.default_rng([self.seed, step, r]).standard_normal(
            (self.grid,) * 2).astype(np.float32) for r in range(start, stop)])
        lap = sum(np.roll(u, s, axis=a) for a in (1, 2) for s in (1, -1)) - 4 * u
        return {"u0": u[..., None], "u1": (u + 0.1 * lap)[..., None]}


class PlainConvTask(spmd.Task):
    class Config(spmd.ModelConfig):
        width: int = 32
        grid: int = 16

    def build_model(self, rngs):
        return PlainConvNet(self.cfg.model.width, rngs=rngs)

    def batch_fields(self):
        shape = (self.cfg.model.grid,) * 2 + (1,)
        return {"u0": spmd.BatchField(shape, np.float32, FIELD),
                "u1": spmd.BatchField(shape, np.float32, FIELD)}

    def loss(self, model, batch):
        return jnp.mean((model(batch["u0"]) - batch["u1"]) ** 2), {}

    def train_source(self):
        return DiffusionSource(self.cfg.train.seed, self.cfg.model.grid)


class Exploding(nnx.Module):
    def __call__(self, x):
        raise ValueError("boom from the model's layer")


class RaisingTask(PlainConvTask):
    def build_model(self, rngs):
        model = PlainConvNet(self.cfg.model.width, rngs=rngs)
        model.conv2 = Exploding()
        return model


class AttentionModel(nnx.Module):
    def __init__(self, features: int, *, rngs: nnx.Rngs):
        # decode=None, as Flax's lm1b builds it: each call must be told (here: by the mode)
        self.attn = nnx.MultiHeadAttention(2, features, decode=None, dropout_rate=0.0,
                                           rngs=rngs)

    def __call__(self, x):
        return self.attn(x)


class SequenceSource:
    def __init__(self, seed: int, length: int, features: int):
        self.seed, self.length, self.features = seed, length, features

    def rows(self, step, start, stop):
        x = np.stack([np.random.default_rng([self.seed, step, r]).standard_normal(
            (self.length, self.features)).astype(np.float32) for r in range(start, stop)])
        return {"x": x, "y": np.cumsum(x, axis=1) / self.length}


class AttentionTask(spmd.Task):
    """Flax's attention with decode=None and no mode hook: tracing the step fails."""

    class Config(spmd.ModelConfig):
        features: int = 8
        length: int = 4

    def build_model(self, rngs):
        return AttentionModel(self.cfg.model.features, rngs=rngs)

    def batch_fields(self):
        shape = (self.cfg.model.length, self.cfg.model.features)
        return {"x": spmd.BatchField(shape, np.float32, ("batch", None, None)),
                "y": spmd.BatchField(shape, np.float32, ("batch", None, None))}

    def loss(self, model, batch):
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2), {}

    def eval_metrics(self, model, batch):
        return {"eval_loss": self.loss(model, batch)[0],
                "deterministic": jnp.float32(model.attn.deterministic)}

    def train_source(self):
        m = self.cfg.model
        return SequenceSource(self.cfg.train.seed, m.length, m.features)

    def eval_source(self):
        m = self.cfg.model
        return SequenceSource(self.cfg.train.seed + 1, m.length, m.features)


class DecodeModeTask(AttentionTask):
    """The same model; the Task's mode hooks also set decode=False, as Flax's train.py does."""

    def train_mode(self, model):
        model.train()
        model.set_attributes(decode=False)

    def eval_mode(self, model):
        model.eval()
        model.set_attributes(decode=False)
