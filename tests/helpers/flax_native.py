"""Models spmd did not write, named by tests' `task: tests.helpers.flax_native:...`.

`FlaxLMTask`: a small decoder-only Transformer written for Flax, in the style of Flax's lm1b
example: every parameter annotated only through `nnx.with_partitioning` (Flax's own
metadata, logical names 'vocab', 'embed', 'mlp', 'heads', 'kv'), one of them with a short
spec (the MLP's down projection names only its first dimension), no `spmd.sharding`
import in the model, and Flax-style `logical_axis_rules` that name the model's own mesh
axis 'model' (tests map it with `mesh.axis_aliases.model=tensor`).

`ConvTask`: a 3-D conv net whose kernels (3, 3, 3, c_in, c_out) carry only names that no
preset puts on `fsdp` ('channels'); under `fsdp` auto-FSDP splits it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import spmd
from spmd.data.sources.synthetic import ArithmeticTokens
from spmd.sharding import with_axes

# ---------------------------------------------------------------- the Flax-native model

init = nnx.initializers.xavier_uniform()
zeros = nnx.initializers.zeros_init()
ones = nnx.initializers.ones_init()
part = nnx.with_partitioning


class MlpBlock(nnx.Module):
    def __init__(self, d_model: int, d_ff: int, *, rngs: nnx.Rngs):
        self.up = nnx.Linear(d_model, d_ff, kernel_init=part(init, ("embed", "mlp")),
                             bias_init=part(zeros, ("mlp",)), rngs=rngs)
        # a short spec, as Flax allows: the trailing ('embed') dimension is replicated
        self.down = nnx.Linear(d_ff, d_model, kernel_init=part(init, ("mlp",)),
                               bias_init=part(zeros, ("embed",)), rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.gelu(self.up(x)))


class SelfAttention(nnx.Module):
    def __init__(self, d_model: int, num_heads: int, *, rngs: nnx.Rngs):
        head_dim = d_model // num_heads

        def proj():
            return nnx.LinearGeneral(d_model, (num_heads, head_dim),
                                     kernel_init=part(init, ("embed", "heads", "kv")),
                                     use_bias=False, rngs=rngs)

        self.query, self.key, self.value = proj(), proj(), proj()
        self.out = nnx.LinearGeneral((num_heads, head_dim), d_model, axis=(-2, -1),
                                     kernel_init=part(init, ("heads", "kv", "embed")),
                                     use_bias=False, rngs=rngs)

    def __call__(self, x):
        q, k, v = self.query(x), self.key(x), self.value(x)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1])
        mask = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
        weights = jax.nn.softmax(jnp.where(mask, scores, -1e9), axis=-1)
        return self.out(jnp.einsum("bhqk,bkhd->bqhd", weights, v))


class Block(nnx.Module):
    def __init__(self, d_model: int, num_heads: int, d_ff: int, *, rngs: nnx.Rngs):
        def norm():
            return nnx.LayerNorm(d_model, scale_init=part(ones, ("embed",)),
                                 bias_init=part(zeros, ("embed",)), rngs=rngs)

        self.norm1, self.norm2 = norm(), norm()
        self.attn = SelfAttention(d_model, num_heads, rngs=rngs)
        self.mlp = MlpBlock(d_model, d_ff, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class FlaxLM(nnx.Module):
    def __init__(self, vocab: int, d_model: int, num_heads: int, d_ff: int, layers: int,
                 seq_len: int, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, d_model, rngs=rngs,
                               embedding_init=part(nnx.initializers.normal(0.02),
                                                   ("vocab", "embed")))
        self.pos = nnx.Param(part(nnx.initializers.normal(0.02), ("length", "embed"))(
            rngs.params(), (seq_len, d_model)))
        self.blocks = nnx.List([Block(d_model, num_heads, d_ff, rngs=rngs)
                                for _ in range(layers)])
        self.norm = nnx.LayerNorm(d_model, scale_init=part(ones, ("embed",)),
                                  bias_init=part(zeros, ("embed",)), rngs=rngs)
        self.head = nnx.Linear(d_model, vocab, kernel_init=part(init, ("embed", "vocab")),
                               bias_init=part(zeros, ("vocab",)), rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens) + self.pos[...][None, : tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class FlaxLMTask(spmd.Task):
    class Config(spmd.ModelConfig):
        vocab: int = 64
        d_model: int = 32
        num_heads: int = 8
        d_ff: int = 64
        layers: int = 1
        seq_len: int = 16

    def build_model(self, rngs):
        m = self.cfg.model
        return FlaxLM(m.vocab, m.d_model, m.num_heads, m.d_ff, m.layers, m.seq_len, rngs=rngs)

    def logical_axis_rules(self):
        # Flax-style, on the model's own mesh ('data', 'model'); 'mlp' twice: the first wins
        return [("batch", "data"), ("vocab", "model"), ("mlp", "model"), ("heads", "model"),
                ("kv", None), ("mlp", None), ("length", None)]

    def batch_fields(self):
        shape = (self.cfg.model.seq_len,)
        return {"inputs": spmd.BatchField(shape, np.int32, ("batch", "length")),
                "targets": spmd.BatchField(shape, np.int32, ("batch", "length"))}

    def loss(self, model, batch):
        logits = model(batch["inputs"]).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits)
        nll = -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)
        return jnp.mean(nll), {}

    def train_source(self):
        m = self.cfg.model
        return ArithmeticTokens(self.cfg.train.seed, self.cfg.train.batch_size, m.seq_len,
                                m.vocab)


# ---------------------------------------------------------------- a conv net with no fsdp rule

KERNEL = ("x", "y", "z", "channels", "channels")
FIELD = ("batch", "x", "y", "z", None)


class ConvNet(nnx.Module):
    def __init__(self, width: int, *, rngs: nnx.Rngs):
        k = nnx.initializers.lecun_normal()

        def conv(c_in, c_out):
            return nnx.Conv(c_in, c_out, (3, 3, 3), padding="SAME", rngs=rngs,
                            kernel_init=with_axes(k, KERNEL),
                            bias_init=with_axes(zeros, ("channels",)))

        self.lift, self.mix, self.out = conv(1, width), conv(width, width), conv(width, 1)

    def __call__(self, u):
        h = jax.nn.gelu(self.lift(u))
        h = jax.nn.gelu(self.mix(h))
        return u + self.out(h)


class ConvSource:
    def __init__(self, seed: int, grid: int):
        self.seed, self.grid = seed, grid

    def rows(self, step, start, stop):
        u = np.stack([np.random.default_rng([self.seed, step, r]).standard_normal(
            (self.grid,) * 3).astype(np.float32) for r in range(start, stop)])
        lap = sum(np.roll(u, s, axis=a) for a in (1, 2, 3) for s in (1, -1)) - 6 * u
        return {"u0": u[..., None], "u1": (u + 0.1 * lap)[..., None]}


class ConvTask(spmd.Task):
    class Config(spmd.ModelConfig):
        width: int = 32
        grid: int = 8

    def build_model(self, rngs):
        return ConvNet(self.cfg.model.width, rngs=rngs)

    def batch_fields(self):
        shape = (self.cfg.model.grid,) * 3 + (1,)
        return {"u0": spmd.BatchField(shape, np.float32, FIELD),
                "u1": spmd.BatchField(shape, np.float32, FIELD)}

    def loss(self, model, batch):
        return jnp.mean((model(batch["u0"]) - batch["u1"]) ** 2), {}

    def train_source(self):
        return ConvSource(self.cfg.train.seed, self.cfg.model.grid)
