"""Acceptance: every preset trains the tiny transformer to the same losses as one device,
and the arrays really are laid out as the rules say."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from spmd.config.load import load_config
from spmd.engine.mesh import build_mesh
from spmd.sharding import activation_sharding
from tests.helpers.env import REPO
from tests.helpers.training import runtime_for, train_steps

pytestmark = pytest.mark.slow   # trains or compiles: the full suite, not -m 'not slow'

CONFIG = REPO / "configs" / "transformer_tiny.yaml"
STEPS = 10


def make(strategy: str, devices, *overrides: str):
    cfg = load_config(CONFIG, [f"mesh.strategy={strategy}", f"train.steps={STEPS}", *overrides])
    return runtime_for(cfg, build_mesh(cfg.mesh, devices))


@pytest.fixture(scope="module")
def reference_losses():
    losses, _ = train_steps(make("dp", jax.devices()[:1]), STEPS)
    assert losses[-1] < losses[0], "the tiny transformer should learn in 10 steps"
    return losses


def per_device_param_bytes(state) -> int:
    device = jax.devices()[0]
    return sum(
        shard.data.nbytes
        for leaf in jax.tree.leaves(state.params)
        for shard in leaf.addressable_shards if shard.device == device
    )


def activations(rt, state):
    """Logits and block-0 output of a real forward pass, with their shardings."""
    tokens = rt.feed.global_batch(rt.task.train_source(), 0)["inputs"]

    def forward(params, tokens):
        with activation_sharding(rt.mesh, rt.rules):
            model = rt.model.merge(params)
            return model(tokens), model.layer(0)(model.embed(tokens))

    return jax.jit(forward)(state.params, tokens)


@pytest.mark.parametrize("strategy", ["dp", "fsdp", "tp", "fsdp_tp", "sp"])
def test_preset_matches_one_device(strategy, reference_losses):
    rt = make(strategy, jax.devices())
    assert rt.mesh.size == 8
    losses, state = train_steps(rt, STEPS)
    np.testing.assert_allclose(losses, reference_losses, rtol=1e-4)

    params = state.params
    # Scanned layers (the default): one stacked array per parameter, ('layers', ...) first.
    assert params["blocks"]["mlp"]["up"]["kernel"].shape[0] == rt.task.cfg.model.num_layers
    up = params["blocks"]["mlp"]["up"]["kernel"].sharding.spec[1:]
    query = params["blocks"]["attn"]["query"].sharding.spec[1:]
    assert tuple(params["blocks"]["mlp"]["up"]["kernel"].sharding.spec)[:1] in ((), (None,))
    logits, hidden = activations(rt, state)
    if strategy == "dp":
        assert tuple(up) in ((), (None, None)) and tuple(query) in ((), (None, None, None))
        assert logits.sharding.spec[0] == "data"
    if strategy in ("fsdp", "fsdp_tp"):
        for leaf_path, leaf in jax.tree_util.tree_leaves_with_path(params):
            name = jax.tree_util.keystr(leaf_path)
            if "kernel" in name or "query" in name or "key" in name or "value" in name:
                # every kernel's embed dimension is on fsdp
                assert "fsdp" in str(leaf.sharding.spec), name
        assert up[0] == "fsdp"
    if strategy in ("tp", "fsdp_tp"):
        assert up[1] == "tensor"  # mlp
        assert query[1] == "tensor"  # heads
        assert logits.sharding.spec[2] == "tensor"  # activation vocab
    if strategy == "sp":
        assert logits.sharding.spec[1] == "context"  # activations' length is sharded
        assert hidden.sharding.spec[1] == "context"


def test_fsdp_bytes_per_device_are_an_eighth_of_dp():
    dp, fsdp = make("dp", jax.devices()), make("fsdp", jax.devices())
    dp_state, fsdp_state = dp.init(), fsdp.init()
    dp_bytes, fsdp_bytes = per_device_param_bytes(dp_state), per_device_param_bytes(fsdp_state)
    replicated = sum(
        leaf.nbytes for leaf in jax.tree.leaves(fsdp_state.params)
        if leaf.sharding.spec == P()
    )
    assert fsdp_bytes <= dp_bytes / 8 + replicated
    assert fsdp_bytes < dp_bytes / 4
    assert fsdp.model.report.bytes_per_device == fsdp_bytes  # the report tells the truth


def test_state_is_created_sharded_not_replicated():
    rt = make("fsdp", jax.devices())
    state = rt.init()
    kernel = state.params["blocks"]["mlp"]["up"]["kernel"]   # (layers, embed, mlp)
    assert kernel.sharding.spec == P(None, "fsdp")
    mu = jax.tree.leaves(state.opt_state)
    assert any(getattr(x, "sharding", None) is not None and x.sharding.spec == P(None, "fsdp")
               for x in mu), "optimizer moments follow their parameter's sharding"
