"""Learn one explicit step of the heat equation on a 3-D grid with a small conv net.

Written as a user of spmd would: only the public API (`spmd.Task`, `spmd.ModelConfig`,
`spmd.BatchField`, `spmd.sharding`), logical axis names only, no mesh axis anywhere.
"""

import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import spmd
from spmd.sharding import constrain, with_axes

FIELD = ("batch", "x", "y", "z", "channels")


class HeatNet(nnx.Module):
    def __init__(self, width: int, *, rngs: nnx.Rngs):
        init, zeros = nnx.initializers.lecun_normal(), nnx.initializers.zeros_init()
        self.lift = nnx.Conv(1, width, (3, 3, 3), padding="SAME", rngs=rngs,
                             kernel_init=with_axes(init, (None, None, None, "channels", "embed")),
                             bias_init=with_axes(zeros, ("embed",)))
        self.mix = nnx.Conv(width, width, (3, 3, 3), padding="SAME", rngs=rngs,
                            kernel_init=with_axes(init, (None, None, None, "embed", "mlp")),
                            bias_init=with_axes(zeros, ("mlp",)))
        self.out = nnx.Conv(width, 1, (1, 1, 1), rngs=rngs,
                            kernel_init=with_axes(init, (None, None, None, "mlp", "channels")),
                            bias_init=with_axes(zeros, ("channels",)))

    def __call__(self, u):
        u = constrain(u, FIELD)
        h = constrain(jax.nn.gelu(self.lift(u)), ("batch", "x", "y", "z", "embed"))
        h = constrain(jax.nn.gelu(self.mix(h)), ("batch", "x", "y", "z", "mlp"))
        return u + self.out(h)


class HeatSource:
    """Random fields and their next heat-equation step: a pure function of (seed, step, row)."""

    def __init__(self, seed: int, grid: int):
        self.seed, self.grid = seed, grid
        self.delay_s = float(os.environ.get("HEAT_STEP_DELAY_S", "0"))  # lets a test kill mid-run

    def rows(self, step, start, stop):
        time.sleep(self.delay_s)
        u = np.stack([np.random.default_rng([self.seed, step, r]).standard_normal(
            (self.grid,) * 3).astype(np.float32) for r in range(start, stop)])
        lap = sum(np.roll(u, s, axis=a) for a in (1, 2, 3) for s in (1, -1)) - 6 * u
        return {"u0": u[..., None], "u1": (u + 0.1 * lap)[..., None]}


class HeatTask(spmd.Task):
    class Config(spmd.ModelConfig):
        width: int = 8
        grid: int = 16

    def build_model(self, rngs):
        return HeatNet(self.cfg.model.width, rngs=rngs)

    def batch_fields(self):
        shape = (self.cfg.model.grid,) * 3 + (1,)
        return {"u0": spmd.BatchField(shape, np.float32, FIELD),
                "u1": spmd.BatchField(shape, np.float32, FIELD)}

    def loss(self, model, batch):
        return jnp.mean((model(batch["u0"]) - batch["u1"]) ** 2), {}

    def train_source(self):
        return HeatSource(self.cfg.train.seed, self.cfg.model.grid)


def not_a_task():
    """Named by a test's `task:` to check the error for something that is not a Task."""
