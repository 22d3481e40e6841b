"""Next-token prediction with the decoder-only Transformer.

GPU-class options of the `model:` section (docs/performance.md says which to use when):
`scan_layers` (stacked blocks run by a scan; default on), `remat` (none, full, dots,
dots_with_batch, save_attention), `attention` (auto, xla, cudnn; auto = cuDNN flash attention
on an NVIDIA GPU with a bf16 model, XLA elsewhere) and `loss_chunk` (tokens per chunk of
the chunked cross-entropy; 0 = whole sequence at once).
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from pydantic import Field, model_validator

from spmd.data.batch import BatchField
from spmd.data.sources.synthetic import ArithmeticTokens
from spmd.errors import ConfigError
from spmd.models.losses import cross_entropy
from spmd.models.scan import Remat
from spmd.models.transformer import TransformerLM
from spmd.tasks.base import ModelConfig, Task

EVAL_STREAM = 1


class TransformerConfig(ModelConfig):
    """model (transformer): a decoder-only Transformer language model on synthetic token
    sequences (docs/performance.md, section 3: scan, remat, attention, chunked loss)."""

    name: Literal["transformer"] = "transformer"
    num_layers: int = Field(2, ge=1, description="Transformer blocks.")
    d_model: int = Field(64, ge=1, description="Width of the residual stream.")
    num_heads: int = Field(4, ge=1, description="Attention heads; must divide d_model.")
    d_ff: int = Field(256, ge=1, description="Hidden width of each block's MLP.")
    vocab_size: int = Field(256, ge=2, description="Tokens in the vocabulary.")
    seq_len: int = Field(32, ge=2, description="Tokens per example.")
    positions: Literal["rotary", "learned"] = Field(
        "rotary", description="Position encoding: rotary, or a learned embedding.")
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="The compute dtype; bfloat16 with param_dtype float32 is the "
        "usual mixed precision.")
    param_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="The dtype the parameters (master weights) are stored in.")
    scan_layers: bool = Field(
        True, description="Blocks stacked as one module (every parameter shaped (num_layers, "
        "...), logical axis `layers`) run by jax.lax.scan; false: a Python loop over blocks/0, "
        "blocks/1, ... (debugging). Both compute the same losses.")
    remat: Remat = Field(
        "none", description="jax.checkpoint around each block with this policy "
        "(models/scan.py REMAT_POLICIES): none keeps everything; dots keeps the weight "
        "matmuls' outputs (the usual choice on GPUs); full keeps only the block input.")
    attention: Literal["auto", "xla", "cudnn"] = Field(
        "auto", description="jax.nn.dot_product_attention's implementation: auto is cudnn on "
        "an NVIDIA GPU with a bfloat16 model and a head dim that is a multiple of 8 and <= 128, "
        "else xla; cudnn anywhere else is a config error.")
    loss_chunk: int = Field(
        0, ge=0, description="Tokens per chunk of the cross-entropy (at most batch x chunk x "
        "vocab float32 logits exist at once); must divide seq_len. 0: the whole sequence.")

    @model_validator(mode="after")
    def _heads_divide(self) -> TransformerConfig:
        if self.d_model % self.num_heads:
            raise ValueError(
                f"d_model={self.d_model} is not divisible by num_heads={self.num_heads}"
            )
        if self.loss_chunk and self.seq_len % self.loss_chunk:
            raise ValueError(f"model.loss_chunk={self.loss_chunk} does not divide "
                             f"model.seq_len={self.seq_len}")
        return self


def _nvidia_gpu() -> bool:
    devices = jax.devices()
    return (jax.default_backend() == "gpu"
            and any("nvidia" in d.device_kind.lower() for d in devices))


def resolve_attention(m: TransformerConfig) -> Literal["xla", "cudnn"]:
    """`model.attention` made concrete for this process: auto -> cudnn where it can run.

    cuDNN flash attention needs an NVIDIA GPU, a bf16 model and a head dimension that
    is a multiple of 8 and at most 128; `auto` takes it only then, an explicit `cudnn`
    elsewhere is a ConfigError naming the key.
    """
    head_dim = m.d_model // m.num_heads
    problems = []
    if not _nvidia_gpu():
        problems.append(f"an NVIDIA GPU (JAX's backend here is '{jax.default_backend()}')")
    if m.dtype not in ("bfloat16",):
        problems.append(f"model.dtype=bfloat16 (not {m.dtype})")
    if head_dim % 8 or head_dim > 128:
        problems.append(f"a head dimension that is a multiple of 8 and <= 128 (d_model / "
                        f"num_heads = {head_dim})")
    if m.attention == "auto":
        return "xla" if problems else "cudnn"
    if m.attention == "cudnn" and problems:
        raise ConfigError(f"model.attention=cudnn (cuDNN flash attention) needs "
                          f"{' and '.join(problems)}; use model.attention=auto or xla")
    return m.attention


class LanguageModelTask(Task[TransformerConfig]):
    Config = TransformerConfig

    def build_model(self, rngs: nnx.Rngs) -> TransformerLM:
        m = self.model_cfg
        return TransformerLM(
            num_layers=m.num_layers, d_model=m.d_model, num_heads=m.num_heads, d_ff=m.d_ff,
            vocab_size=m.vocab_size, seq_len=m.seq_len, positions=m.positions, rngs=rngs,
            dtype=jnp.dtype(m.dtype), scan_layers=m.scan_layers, remat=m.remat,
            attention=resolve_attention(m), param_dtype=jnp.dtype(m.param_dtype),
        )

    def batch_fields(self) -> dict[str, BatchField]:
        shape = (self.model_cfg.seq_len,)
        axes = ("batch", "length")
        return {"inputs": BatchField(shape, np.dtype(np.int32), axes),
                "targets": BatchField(shape, np.dtype(np.int32), axes)}

    def loss(self, model, batch):
        hidden = model.features(batch["inputs"])
        loss, accuracy = cross_entropy(model.logits, hidden, batch["targets"],
                                       self.model_cfg.loss_chunk)
        return loss, {"accuracy": accuracy}

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

