"""Tasks whose models use dropout, for the tests of randomness and modes (issue 20).

`DropoutTask`: an MLP with `nnx.Dropout(rate)` that holds no RNG state; its `loss` takes the
optional keywords `rngs` and `train` and passes `rngs` to the model. `HeldRngsTask`: the same
model with `nnx.Dropout(rate, rngs=rngs)` (the module keeps an RngKey/RngCount, as Flax's own
lm1b model does) and the plain 2-argument loss. Both regress onto spmd's fixed teacher.

    task: tests.helpers.dropout_task:DropoutTask
    model: {d_in: 8, d_hidden: 32, d_out: 4, dropout: 0.1}
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from pydantic import Field

import spmd
from spmd.models.layers import Dense
from spmd.tasks.regression import RegressionTask


class DropoutConfig(spmd.ModelConfig):
    d_in: int = Field(8, ge=1)
    d_hidden: int = Field(32, ge=1)
    d_out: int = Field(4, ge=1)
    dropout: float = Field(0.1, ge=0.0, lt=1.0)


class DropoutMlp(nnx.Module):
    def __init__(self, m: DropoutConfig, *, rngs: nnx.Rngs, hold_rngs: bool = False):
        self.up = Dense(m.d_in, m.d_hidden, ("embed", "mlp"), rngs=rngs)
        self.down = Dense(m.d_hidden, m.d_out, ("mlp", "channels"), rngs=rngs)
        self.drop = nnx.Dropout(m.dropout, rngs=rngs if hold_rngs else None)

    def __call__(self, x: jax.Array, *, rngs: nnx.Rngs | None = None) -> jax.Array:
        return self.down(self.drop(jax.nn.gelu(self.up(x)), rngs=rngs))


class DropoutTask(RegressionTask):
    """RegressionTask's fields and teacher data, with the dropout MLP and the keyword loss."""

    Config = DropoutConfig
    hold_rngs = False

    def build_model(self, rngs: nnx.Rngs) -> DropoutMlp:
        return DropoutMlp(self.model_cfg, rngs=rngs, hold_rngs=self.hold_rngs)

    def loss(self, model, batch, *, rngs: nnx.Rngs | None = None, train: bool = True):
        pred = model(batch["inputs"], rngs=rngs)
        return jnp.mean((pred - batch["targets"]) ** 2), {"train_mode": jnp.float32(train)}

    def eval_metrics(self, model, batch, **options) -> dict:
        loss, _ = self.loss(model, batch, **options)
        return {"eval_loss": loss, "eval_train_flag": jnp.float32(options.get("train", True))}


class HeldRngsTask(DropoutTask):
    """Dropout holds its own RNG stream (`nnx.Dropout(rate, rngs=rngs)`); 2-argument loss."""

    hold_rngs = True

    def loss(self, model, batch):
        return jnp.mean((model(batch["inputs"]) - batch["targets"]) ** 2), {}

    def eval_metrics(self, model, batch) -> dict:
        return {"eval_loss": self.loss(model, batch)[0]}
