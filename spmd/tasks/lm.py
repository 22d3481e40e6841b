"""Next-token prediction with the decoder-only Transformer."""

from __future__ import annotations

from typing import Literal

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from pydantic import Field, model_validator

from spmd.config import ModelConfig
from spmd.data.batch import BatchField
from spmd.data.synthetic import ArithmeticTokens
from spmd.models.transformer import TransformerLM
from spmd.tasks.base import Task

EVAL_STREAM = 1


class TransformerConfig(ModelConfig):
    name: Literal["transformer"] = "transformer"
    num_layers: int = Field(2, ge=1)
    d_model: int = Field(64, ge=1)
    num_heads: int = Field(4, ge=1)
    d_ff: int = Field(256, ge=1)
    vocab_size: int = Field(256, ge=2)
    seq_len: int = Field(32, ge=2)
    positions: Literal["rotary", "learned"] = "rotary"
    dtype: Literal["float32", "bfloat16"] = "float32"

    @model_validator(mode="after")
    def _heads_divide(self) -> TransformerConfig:
        if self.d_model % self.num_heads:
            raise ValueError(
                f"d_model={self.d_model} is not divisible by num_heads={self.num_heads}"
            )
        return self


class LanguageModelTask(Task):
    Config = TransformerConfig

    @property
    def model_cfg(self) -> TransformerConfig:
        return self.cfg.model

    def build_model(self, rngs: nnx.Rngs) -> TransformerLM:
        m = self.model_cfg
        return TransformerLM(
            num_layers=m.num_layers, d_model=m.d_model, num_heads=m.num_heads, d_ff=m.d_ff,
            vocab_size=m.vocab_size, seq_len=m.seq_len, positions=m.positions, rngs=rngs,
            dtype=jnp.dtype(m.dtype),
        )

    def batch_fields(self) -> dict[str, BatchField]:
        shape = (self.model_cfg.seq_len,)
        axes = ("batch", "length")
        return {"inputs": BatchField(shape, np.dtype(np.int32), axes),
                "targets": BatchField(shape, np.dtype(np.int32), axes)}

    def loss(self, model, batch):
        logits = model(batch["inputs"]).astype(jnp.float32)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
        accuracy = jnp.mean(jnp.argmax(logits, -1) == batch["targets"])
        return jnp.mean(losses), {"accuracy": accuracy}

    def _source(self, stream: int) -> ArithmeticTokens:
        m = self.model_cfg
        return ArithmeticTokens(self.cfg.train.seed, self.cfg.train.batch_size, m.seq_len,
                                m.vocab_size, stream=stream)

    def train_source(self) -> ArithmeticTokens:
        return self._source(0)

    def eval_source(self) -> ArithmeticTokens | None:
        return self._source(EVAL_STREAM) if self.cfg.train.eval_every else None

    def eval_metrics(self, model, batch) -> dict:
        loss, aux = self.loss(model, batch)
        return {"eval_loss": loss, "eval_accuracy": aux["accuracy"]}

    def tokens_per_example(self) -> int:
        return self.model_cfg.seq_len

    def flops_per_example(self) -> float:
        """PaLM formula: 6 N per token plus causal attention (12 L H Q T, halved)."""
        m = self.model_cfg
        n_params = (m.num_layers * (4 * m.d_model * m.d_model + 2 * m.d_model * m.d_ff)
                    + 2 * m.vocab_size * m.d_model)
        attention = 12 * m.num_layers * m.d_model * m.seq_len / 2
        return float(m.seq_len * (6 * n_params + attention))

