"""GPU-class transformer options on CPU: scanned layers, remat policies, attention, chunked loss.

Acceptance for issue 12 that CPU can check: a scanned model (each remat policy) trains to the
same losses as the unrolled one under every preset on 8 devices; XLA attention matches a
float64 reference; cuDNN on CPU is a config error naming `model.attention`; the chunked
cross-entropy equals the plain one in value and gradient; the stacked parameters carry their
`layers` axis in the sharding report and survive a checkpoint resume bit for bit.

What each case covers, one compile per case: CASES runs every preset and every remat policy
once (2 layers: the scan still runs several iterations); the gradient test compares each
policy against one unrolled reference, computed once; the chunked-loss cases share one plain
loss; the `spmd shardings` commands run in one child process (tests/helpers/cli_batch.py).
"""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from spmd.config.load import build_task, load_config
from spmd.engine.mesh import build_mesh
from spmd.errors import ConfigError
from spmd.models.attention import causal_attention, einsum_attention
from spmd.models.losses import cross_entropy
from spmd.models.scan import REMAT_POLICIES
from spmd.models.transformer import TransformerLM
from tests.helpers.cli_batch import run_batch
from tests.helpers.env import REPO, clean_env, run_spmd
from tests.helpers.training import runtime_for, train_steps

pytestmark = pytest.mark.slow   # trains or compiles: the full suite, not -m 'not slow'

CONFIG = REPO / "configs" / "transformer_tiny.yaml"
STEPS = 3
TINY = dict(num_layers=3, d_model=32, num_heads=4, d_ff=64, vocab_size=64, seq_len=16)


def losses(strategy: str, *overrides: str, devices=None) -> list[float]:
    cfg = load_config(CONFIG, [f"mesh.strategy={strategy}", f"train.steps={STEPS}",
                               "model.num_layers=2", "model.attention=xla", *overrides])
    rt = runtime_for(cfg, build_mesh(cfg.mesh, devices or jax.devices()))
    assert rt.mesh.size == len(devices or jax.devices())
    return train_steps(rt, STEPS)[0]


# Every preset once and every remat policy once, one compile each: the chunked loss under
# sp and tp (length and vocab sharded), the plain one under dp, fsdp and fsdp_tp. (fsdp with
# remat=dots trains and resumes in test_scanned_model_resumes_bit_identical.)
CASES = [("dp", "full", 0), ("fsdp", "none", 0), ("tp", "dots_with_batch", 8),
         ("fsdp_tp", "save_attention", 0), ("sp", "dots", 8)]


@functools.cache
def unrolled_losses(strategy: str) -> tuple[float, ...]:
    return tuple(losses(strategy, "model.scan_layers=false"))


@pytest.mark.parametrize("strategy,remat,chunk", CASES)
def test_scanned_matches_unrolled_on_8_devices(strategy, remat, chunk):
    unrolled = unrolled_losses(strategy)
    scanned = losses(strategy, "model.scan_layers=true", f"model.remat={remat}",
                     f"model.loss_chunk={chunk}")
    np.testing.assert_allclose(scanned, unrolled, rtol=1e-5)
    assert scanned[-1] < scanned[0]


def _model(**kw) -> TransformerLM:
    return TransformerLM(**TINY, rngs=nnx.Rngs(0), **kw)


def _loss_and_grads(model: TransformerLM, tokens, chunk: int = 0):
    graphdef, params = nnx.split(model, nnx.Param)

    def loss_fn(p):
        m = nnx.merge(graphdef, p)
        return cross_entropy(m.logits, m.features(tokens[:, :-1]), tokens[:, 1:], chunk)[0]

    return jax.value_and_grad(loss_fn)(params)


def _unstack(grads_scanned, grads_unrolled):
    """Scanned grads as the unrolled model's pure dict (blocks/i/...), for comparison."""
    g = nnx.to_pure_dict(grads_scanned)
    blocks = g.pop("blocks")
    n = len(nnx.to_pure_dict(grads_unrolled)["blocks"])
    g["blocks"] = {i: jax.tree.map(lambda x, i=i: x[i], blocks) for i in range(n)}
    return g


@functools.cache
def _unrolled_loss_and_grads(seed: int):
    """The unrolled model's loss and gradients on tokens of `seed` (once per module)."""
    tokens = jax.random.randint(jax.random.key(seed), (2, TINY["seq_len"] + 1), 0, 64)
    return tokens, *_loss_and_grads(_model(scan_layers=False), tokens)


@pytest.mark.parametrize("remat", list(REMAT_POLICIES))
def test_every_remat_policy_gives_the_unrolled_gradients(remat):
    tokens, loss_u, grads_u = _unrolled_loss_and_grads(1)
    loss_s, grads_s = jax.jit(lambda t: _loss_and_grads(_model(remat=remat), t))(tokens)
    np.testing.assert_allclose(loss_s, loss_u, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
                 _unstack(grads_s, grads_u), nnx.to_pure_dict(grads_u))


def _f64_attention(q, k, v):
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    length = q.shape[1]
    scores = np.where(np.tril(np.ones((length, length), bool)), scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", weights, v)


def test_xla_attention_matches_float64_and_the_hand_written_one():
    q, k, v = jax.random.normal(jax.random.key(0), (3, 2, 24, 4, 16), jnp.float32)
    xla = causal_attention(q, k, v, "xla")
    np.testing.assert_allclose(xla, _f64_attention(q, k, v), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(xla, einsum_attention(q, k, v), rtol=1e-5, atol=1e-6)


def test_cudnn_attention_on_cpu_is_a_config_error_naming_the_key():
    cfg = load_config(CONFIG, ["model.attention=cudnn", "model.dtype=bfloat16"])
    with pytest.raises(ConfigError, match=r"model\.attention=cudnn .*NVIDIA GPU.*'cpu'"):
        runtime_for(cfg, build_mesh(cfg.mesh, jax.devices()[:1]))
    auto = load_config(CONFIG, ["model.attention=auto"])
    assert build_task(auto).build_model(nnx.Rngs(0)).layer(0).attn.implementation == "xla"


@pytest.fixture(scope="module")
def shardings():
    """`spmd shardings` of the tests below, on 8 devices, in one child process
    (tests/helpers/cli_batch.py) instead of one Python start each."""
    env = clean_env(JAX_NUM_CPU_DEVICES="8", SPMD_MPI="0")
    runs = {"remat": ("model.remat=everything",), "loss_chunk": ("model.loss_chunk=5",),
            "json": ("mesh.strategy=fsdp_tp", "--json"), "text": ()}
    return dict(zip(runs, run_batch([(env, ["shardings", str(CONFIG), *args])
                                     for args in runs.values()])))


def test_bad_remat_and_loss_chunk_name_their_keys(shardings):
    r = shardings["remat"]
    assert r.returncode != 0 and "model.remat" in r.stderr, r.stderr
    r = shardings["loss_chunk"]
    assert r.returncode != 0 and "model.loss_chunk=5" in r.stderr, r.stderr


@functools.cache
def _plain_cross_entropy():
    """The scanned model, its tokens, and the plain loss and gradients (once per module)."""
    model = _model(scan_layers=True)
    tokens = jax.random.randint(jax.random.key(2), (2, TINY["seq_len"] + 1), 0, 64)
    return model, tokens, *jax.jit(lambda t: _loss_and_grads(model, t, 0))(tokens)


@pytest.mark.parametrize("chunk", [4, 8])
def test_chunked_cross_entropy_equals_the_plain_one(chunk):
    model, tokens, plain, g_plain = _plain_cross_entropy()
    chunked, g_chunked = jax.jit(lambda t: _loss_and_grads(model, t, chunk))(tokens)
    np.testing.assert_allclose(chunked, plain, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
                 nnx.to_pure_dict(g_chunked), nnx.to_pure_dict(g_plain))
    # accuracy too
    m = model
    h = m.features(tokens[:, :-1])
    acc_plain = cross_entropy(m.logits, h, tokens[:, 1:], 0)[1]
    acc_chunked = cross_entropy(m.logits, h, tokens[:, 1:], chunk)[1]
    assert float(acc_plain) == float(acc_chunked)


def test_chunked_loss_keeps_no_full_batch_float32_logits():
    """The compiled backward holds (batch, chunk, vocab) logits, never (batch, length, vocab)."""
    big = dict(TINY, vocab_size=4096, seq_len=64)
    m = TransformerLM(**big, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(m, nnx.Param)
    tokens = jnp.zeros((4, 65), jnp.int32)

    def temp_bytes(chunk):
        def loss_fn(p):
            mm = nnx.merge(graphdef, p)
            return cross_entropy(mm.logits, mm.features(tokens[:, :-1]), tokens[:, 1:],
                                 chunk)[0]
        compiled = jax.jit(jax.grad(loss_fn)).lower(params).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    full_logits = 4 * 64 * 4096 * 4
    plain, chunked = temp_bytes(0), temp_bytes(8)
    assert plain >= full_logits
    assert chunked < plain - full_logits / 2, (plain, chunked)


def test_shardings_report_shows_the_stacked_layers_axis(shardings):
    r = shardings["json"]
    assert r.returncode == 0, r.stderr
    params = {p["path"]: p for p in json.loads(r.stdout)["params"]}
    up = params["blocks/mlp/up/kernel"]
    assert up["shape"] == [2, 64, 256]
    assert up["logical_axes"] == ["layers", "embed", "mlp"]
    assert up["spec"] == [None, "fsdp", "tensor"]
    assert params["blocks/attn/query"]["logical_axes"] == ["layers", "embed", "heads", "kv"]
    assert not any(path.startswith("blocks/0") for path in params)
    text = shardings["text"].stdout
    assert "('layers', 'embed', 'mlp')" in text


def _train_losses(run_dir) -> dict[int, float]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {x["step"]: x["loss"] for x in lines if "loss" in x}


def test_scanned_model_resumes_bit_identical(tmp_path):
    """Train 6 steps straight, and 3 + resume to 6: the same losses, bit for bit."""
    env = clean_env(JAX_NUM_CPU_DEVICES="4")
    common = (str(CONFIG), "mesh.strategy=fsdp", "model.remat=dots", "checkpoint.every=3",
              "checkpoint.persistent_every=3", "run.plots=false")   # losses alone compared
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    r = run_spmd("train", *common, f"run.dir={straight}", "train.steps=6", env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    r = run_spmd("train", *common, f"run.dir={resumed}", "train.steps=3", env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    r = run_spmd("train", *common, f"run.dir={resumed}", "train.steps=6", env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    events = [json.loads(x) for x in (resumed / "events.jsonl").read_text().splitlines()]
    assert any(e["event"] == "restored" and e["step"] == 3 for e in events)
    a, b = _train_losses(straight), _train_losses(resumed)
    assert [a[s] for s in (4, 5, 6)] == [b[s] for s in (4, 5, 6)]
