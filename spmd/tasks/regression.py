"""Regression onto a fixed random teacher with the residual MLP."""

from __future__ import annotations

from typing import Literal

import jax.numpy as jnp
import numpy as np
from flax import nnx
from pydantic import Field

from spmd.data.batch import BatchField
from spmd.data.sources.synthetic import TeacherRegression
from spmd.models.mlp import Mlp
from spmd.tasks.base import ModelConfig, Task


class MlpConfig(ModelConfig):
    """model (mlp): a residual MLP regressing a synthetic teacher's outputs."""

    name: Literal["mlp"] = "mlp"
    d_in: int = Field(32, ge=1, description="Input features.")
    d_hidden: int = Field(128, ge=1, description="Hidden width.")
    d_out: int = Field(8, ge=1, description="Output features.")
    num_layers: int = Field(2, ge=1, description="Residual hidden layers.")
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="The compute dtype; bfloat16 with param_dtype float32 is the "
        "usual mixed precision.")
    param_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="The dtype the parameters (master weights) are stored in.")


class RegressionTask(Task[MlpConfig]):
    Config = MlpConfig

    def build_model(self, rngs: nnx.Rngs) -> Mlp:
        m = self.model_cfg
        return Mlp(m.d_in, m.d_hidden, m.d_out, m.num_layers, rngs=rngs, dtype=jnp.dtype(m.dtype),
                   param_dtype=jnp.dtype(m.param_dtype))

    def batch_fields(self) -> dict[str, BatchField]:
        m = self.model_cfg
        return {"inputs": BatchField((m.d_in,), np.dtype(np.float32), ("batch", "embed")),
                "targets": BatchField((m.d_out,), np.dtype(np.float32), ("batch", "channels"))}

    def loss(self, model, batch):
        pred = model(batch["inputs"]).astype(jnp.float32)
        return jnp.mean((pred - batch["targets"]) ** 2), {}

    def _source(self, stream: int) -> TeacherRegression:
        m = self.model_cfg
        return TeacherRegression(self.cfg.train.seed, m.d_in, m.d_out, stream=stream)

    def train_source(self) -> TeacherRegression:
        return self._source(0)

    def eval_source(self) -> TeacherRegression | None:
        return self._source(1) if self.cfg.train.eval_every else None

    def eval_metrics(self, model, batch) -> dict:
        return {"eval_loss": self.loss(model, batch)[0]}
