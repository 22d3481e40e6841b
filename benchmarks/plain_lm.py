"""The same transformer LM step written in plain JAX + optax, for `gpu_mfu.py --compare`.

No spmd, no Flax in the step: functions over a params pytree shaped like spmd's pure dict
(blocks stacked along a leading layer axis), `jax.lax.scan` over the layers, the same
attention implementation and remat policy, `optax.chain(clip_by_global_norm, adamw)`,
`jax.jit` with donation on one device. The benchmark starts both from the same parameter
values and checks that their first losses agree before timing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "dots_with_batch": jax.checkpoint_policies.dots_saveable,
    "save_attention": jax.checkpoint_policies.save_only_these_names("attention_out"),
}


def _norm(x, scale, eps=1e-6):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * scale).astype(x.dtype)


def _rotary(x, base=10_000.0):
    half = x.shape[-1] // 2
    freqs = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] * freqs[None, :]
    sin, cos = jnp.sin(angles)[None, :, None, :], jnp.cos(angles)[None, :, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(x.dtype)


def make_step(*, dtype, attention: str, remat: str, lr: float, weight_decay: float,
              grad_clip: float | None, loss_chunk: int = 0):
    """(params, opt_state, batch) -> (params, opt_state, loss), jitted, donating the state."""
    parts = [optax.clip_by_global_norm(grad_clip)] if grad_clip else []
    tx = optax.chain(*parts, optax.adamw(optax.constant_schedule(lr), weight_decay=weight_decay))

    def block(x, p):
        h = _norm(x, p["attn_norm"]["scale"]).astype(dtype)
        a = p["attn"]
        q, k, v = (jnp.einsum("ble,ehd->blhd", h, a[n].astype(dtype))
                   for n in ("query", "key", "value"))
        q, k = _rotary(q), _rotary(k)
        ctx = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=attention)
        ctx = jax.ad_checkpoint.checkpoint_name(ctx, "attention_out")
        x = x + jnp.einsum("blhd,hde->ble", ctx, a["out"].astype(dtype)).astype(x.dtype)
        h = _norm(x, p["mlp_norm"]["scale"]).astype(dtype)
        m = p["mlp"]
        h = jax.nn.gelu(jnp.einsum("ble,ef->blf", h, m["up"]["kernel"].astype(dtype)))
        return x + jnp.einsum("blf,fe->ble", h, m["down"]["kernel"].astype(dtype)).astype(x.dtype)

    if remat != "none":
        block = jax.checkpoint(block, policy=POLICIES[remat], prevent_cse=False)

    def ce(h, w, t):
        logits = jnp.einsum("ble,ev->blv", h.astype(dtype), w.astype(dtype)).astype(jnp.float32)
        return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits, t))

    def loss_fn(params, batch):
        x = jnp.take(params["embedding"], batch["inputs"], axis=0)
        x, _ = jax.lax.scan(lambda c, p: (block(c, p), None), x, params["blocks"])
        h = _norm(x, params["final_norm"]["scale"])
        w, t = params["unembed"]["kernel"], batch["targets"]
        b, n_tok = t.shape
        if loss_chunk and loss_chunk < n_tok:
            n = n_tok // loss_chunk
            hs = jnp.moveaxis(h.reshape(b, loss_chunk, n, h.shape[-1]), 2, 0)
            ts = jnp.moveaxis(t.reshape(b, loss_chunk, n), 2, 0)
            one = jax.checkpoint(ce)
            total, _ = jax.lax.scan(lambda c, xs: (c + one(xs[0], w, xs[1]), None),
                                    jnp.zeros((), jnp.float32), (hs, ts))
        else:
            total = ce(h, w, t)
        return total / (b * n_tok)

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return tx, jax.jit(step, donate_argnums=(0, 1))
