"""A Transformer written for JAX's explicit sharding, in the style of Flax's Gemma example
(google/flax examples/gemma), for issue 36 item 2. Written for these tests, not copied.

What makes it "explicit-sharding style":
- a frozen `ShardingConfig` dataclass holding `PartitionSpec`s of *mesh-axis* names (not
  logical names), with a `fsdp_tp()` table and a `no_sharding()` one;
- parameters annotated with those specs through Flax's own metadata (`kernel_metadata=
  {'out_sharding': ...}`, `embedding_metadata=`, and `nnx.Param(value, out_sharding=...)`);
- einsums that pass `out_sharding=P(...)` (they need `jax.set_mesh` around the jitted call
  and a mesh whose axes are `AxisType.Explicit`), and a `jax.sharding.reshard` of the
  logits before the loss.
Nothing of spmd is imported by the model. The task selects the table (`model.sharding`);
the run sets `mesh.axis_types: explicit`.

    task: tests.helpers.explicit_sharding:ExplicitLMTask
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

import spmd
from spmd.data.sources.synthetic import ArithmeticTokens


@dataclasses.dataclass(frozen=True)
class ShardingConfig:
    """Where each weight and activation lives, by mesh axis (None: not sharded)."""

    emb_vd: P | None = None        # embedding (vocab, embed)
    pos_td: P | None = None        # positions (length, embed)
    qkv_sdnh: P | None = None      # q/k/v projection (3, embed, heads, head_dim)
    out_nhd: P | None = None       # attention output (heads, head_dim, embed)
    ffw_df: P | None = None        # MLP up (embed, hidden)
    ffw_fd: P | None = None        # MLP down (hidden, embed)
    norm_d: P | None = None        # RMSNorm scale (embed,)
    head_dv: P | None = None       # output projection (embed, vocab)
    act_btd: P | None = None       # residual stream (batch, length, embed)
    act_btf: P | None = None       # MLP hidden (batch, length, hidden)
    act_sbtnh: P | None = None     # q/k/v (3, batch, length, heads, head_dim)
    act_bnts: P | None = None      # attention scores (batch, heads, length, length)
    act_btv: P | None = None       # logits (batch, length, vocab)

    @staticmethod
    def no_sharding() -> ShardingConfig:
        return ShardingConfig()

    @staticmethod
    def fsdp_tp(fsdp: str = "fsdp", tp: str = "tensor") -> ShardingConfig:
        """Weights split over fsdp and tp; activations' batch over fsdp, features over tp."""
        return ShardingConfig(
            emb_vd=P(tp, fsdp), pos_td=P(None, fsdp), qkv_sdnh=P(None, fsdp, tp, None),
            out_nhd=P(tp, None, fsdp), ffw_df=P(fsdp, tp), ffw_fd=P(tp, fsdp), norm_d=P(tp),
            head_dv=P(fsdp, tp),
            act_btd=P(fsdp, None, tp), act_btf=P(fsdp, None, tp),
            act_sbtnh=P(None, fsdp, None, tp, None), act_bnts=P(fsdp, tp, None, None),
            act_btv=P(fsdp, None, None))


def _meta(spec: P | None) -> dict:
    return {"out_sharding": spec} if spec is not None else {}


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, shd: ShardingConfig, *, rngs: nnx.Rngs):
        self.scale = nnx.Param(jnp.zeros((dim,)), **_meta(shd.norm_d))

    def __call__(self, x):
        var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
        return x * jax.lax.rsqrt(var + 1e-6) * (1.0 + self.scale[...])


class Attention(nnx.Module):
    def __init__(self, d_model: int, num_heads: int, shd: ShardingConfig, *, rngs: nnx.Rngs):
        head_dim = d_model // num_heads
        self.shd = shd
        self.qkv = nnx.Einsum("BTD,SDNH->SBTNH", (3, d_model, num_heads, head_dim),
                              kernel_metadata=_meta(shd.qkv_sdnh), rngs=rngs)
        self.out = nnx.Einsum("BTNH,NHD->BTD", (num_heads, head_dim, d_model),
                              kernel_metadata=_meta(shd.out_nhd), rngs=rngs)

    def __call__(self, x):
        q, k, v = self.qkv(x, out_sharding=self.shd.act_sbtnh)
        scores = jnp.einsum("BTNH,BSNH->BNTS", q, k, out_sharding=self.shd.act_bnts)
        scores = scores / jnp.sqrt(q.shape[-1]).astype(scores.dtype)
        t = x.shape[1]
        mask = jnp.tril(jnp.ones((t, t), bool))
        weights = jax.nn.softmax(jnp.where(mask, scores, -1e9), axis=-1)
        mixed = jnp.einsum("BNTS,BSNH->BTNH", weights, v,
                           out_sharding=None if self.shd.act_sbtnh is None
                           else P(*self.shd.act_sbtnh[1:]))
        return self.out(mixed, out_sharding=self.shd.act_btd)


class FeedForward(nnx.Module):
    def __init__(self, d_model: int, d_ff: int, shd: ShardingConfig, *, rngs: nnx.Rngs):
        self.shd = shd
        self.up = nnx.Einsum("BTD,DF->BTF", (d_model, d_ff), kernel_metadata=_meta(shd.ffw_df),
                             rngs=rngs)
        self.down = nnx.Einsum("BTF,FD->BTD", (d_ff, d_model),
                               kernel_metadata=_meta(shd.ffw_fd), rngs=rngs)

    def __call__(self, x):
        h = jax.nn.gelu(self.up(x, out_sharding=self.shd.act_btf))
        return self.down(h, out_sharding=self.shd.act_btd)


class Block(nnx.Module):
    def __init__(self, d_model: int, num_heads: int, d_ff: int, shd: ShardingConfig, *,
                 rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(d_model, shd, rngs=rngs)
        self.attn = Attention(d_model, num_heads, shd, rngs=rngs)
        self.ffw_norm = RMSNorm(d_model, shd, rngs=rngs)
        self.ffw = FeedForward(d_model, d_ff, shd, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.ffw(self.ffw_norm(x))


class ExplicitLM(nnx.Module):
    def __init__(self, vocab: int, d_model: int, num_heads: int, d_ff: int, layers: int,
                 seq_len: int, shd: ShardingConfig, *, rngs: nnx.Rngs):
        self.shd = shd
        normal = nnx.initializers.normal(0.02)
        self.embed = nnx.Embed(vocab, d_model, embedding_init=normal,
                               embedding_metadata=_meta(shd.emb_vd), rngs=rngs)
        self.pos = nnx.Param(normal(rngs.params(), (seq_len, d_model)), **_meta(shd.pos_td))
        self.blocks = nnx.List([Block(d_model, num_heads, d_ff, shd, rngs=rngs)
                                for _ in range(layers)])
        self.norm = RMSNorm(d_model, shd, rngs=rngs)
        self.head = nnx.Einsum("BTD,DV->BTV", (d_model, vocab),
                               kernel_metadata=_meta(shd.head_dv), rngs=rngs)

    def __call__(self, tokens):
        t = tokens.shape[1]
        x = self.embed(tokens, out_sharding=self.shd.act_btd)
        pos = self.pos[...][:t]
        if self.shd.act_btd is not None:   # the positions, laid out like the residual stream
            pos = jax.sharding.reshard(pos, P(*self.shd.act_btd[1:]))
        x = x + pos[None]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x), out_sharding=self.shd.act_btd)
        if self.shd.act_btv is not None:   # the vocabulary whole on each device for the loss
            logits = jax.sharding.reshard(logits, self.shd.act_btv)
        return logits


class ExplicitLMTask(spmd.Task):
    """Next-token prediction of `ArithmeticTokens` with `ExplicitLM`."""

    class Config(spmd.ModelConfig):
        vocab: int = 64
        d_model: int = 32
        num_heads: int = 4
        d_ff: int = 64
        layers: int = 1
        seq_len: int = 16
        sharding: Literal["fsdp_tp", "none"] = "fsdp_tp"
        tp_axis: str = "tensor"   # the mesh axis the table names for tensor parallelism

    def sharding_config(self) -> ShardingConfig:
        if self.cfg.model.sharding == "none":
            return ShardingConfig.no_sharding()
        return ShardingConfig.fsdp_tp(tp=self.cfg.model.tp_axis)

    def build_model(self, rngs):
        m = self.cfg.model
        return ExplicitLM(m.vocab, m.d_model, m.num_heads, m.d_ff, m.layers, m.seq_len,
                          self.sharding_config(), rngs=rngs)

    def batch_fields(self):
        shape = (self.cfg.model.seq_len,)
        return {"inputs": spmd.BatchField(shape, np.int32, ("batch", "length")),
                "targets": spmd.BatchField(shape, np.int32, ("batch", "length"))}

    def loss(self, model, batch):
        logp = jax.nn.log_softmax(model(batch["inputs"]).astype(jnp.float32))
        nll = -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)
        return jnp.mean(nll), {}

    def eval_metrics(self, model, batch):
        return {"eval_loss": self.loss(model, batch)[0]}

    def train_source(self):
        m = self.cfg.model
        return ArithmeticTokens(self.cfg.train.seed, self.cfg.train.batch_size, m.seq_len,
                                m.vocab)

    def eval_source(self):
        m = self.cfg.model
        return ArithmeticTokens(self.cfg.train.seed + 1, self.cfg.train.batch_size, m.seq_len,
                                m.vocab)

    def predict(self, model, batch):
        return jnp.argmax(model(batch["inputs"]), axis=-1)
