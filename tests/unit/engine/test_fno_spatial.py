"""The FNO under the `spatial` preset: the grid really is split across devices, and a few
training steps give the same losses as one device (FFTs over sharded x/y included)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import spmd.models.fno
from spmd.config.load import load_config
from spmd.engine.mesh import build_mesh
from tests.helpers.fno import make_tiny_dataset, tiny_config
from tests.helpers.training import runtime_for, train_steps

STEPS = 3


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fno_spatial")
    return tiny_config(tmp, make_tiny_dataset(tmp / "darcy.h5"))


def runtime(config, devices, *overrides):
    cfg = load_config(config, [f"train.steps={STEPS}", *overrides])
    rt = runtime_for(cfg, build_mesh(cfg.mesh, devices))
    rt.task.prepare(True)
    return rt


@pytest.fixture(scope="module")
def reference(config):
    losses, _ = train_steps(runtime(config, jax.devices()[:1]), STEPS)
    return losses


def activation_specs(rt, state) -> dict[str, P]:
    """Every activation the model constrains, with the sharding it has on the devices."""
    seen: dict[str, P] = {}
    original = spmd.models.fno.constrain

    def spy(x, axes, name=None):
        y = original(x, axes, name)
        jax.debug.inspect_array_sharding(y, callback=lambda s, n=name: seen.__setitem__(n, s))
        return y

    batch = rt.feed.global_batch(rt.task.train_source(), 0)
    spmd.models.fno.constrain = spy
    try:
        rt.eval_step(state.params, batch)  # a fresh trace: the spy sees every constraint
    finally:
        spmd.models.fno.constrain = original
    return {name: s.spec for name, s in seen.items()}


@pytest.mark.parametrize("axes", [("context=4", "tensor=2"), ("context=8",)])
def test_spatial_matches_one_device_and_splits_the_grid(config, reference, axes):
    rt = runtime(config, jax.devices(), "mesh.strategy=spatial",
                 *[f"mesh.axes.{a}" for a in axes])
    assert rt.mesh.size == 8
    losses, state = train_steps(rt, STEPS)
    np.testing.assert_allclose(losses, reference, rtol=1e-4)
    assert losses[-1] < losses[0]

    y_axis = "tensor" if rt.mesh.shape["tensor"] > 1 else None
    specs = activation_specs(rt, state)
    assert {"fno/lift", "fno/layer0", "fno/layer1", "fno/output"} <= set(specs)
    for name, spec in specs.items():
        spec = tuple(spec) + (None,) * (4 - len(spec))
        assert spec[:3] == (None, "context", y_axis), (name, spec)
    # every device holds 1/8 of a field
    batch = rt.feed.global_batch(rt.task.train_source(), 0)
    shard = batch["a"].addressable_shards[0].data
    assert shard.size * 8 == batch["a"].size

    # parameters: read from the state; nothing in the FNO is x/y-shaped, so all replicated
    for leaf in jax.tree.leaves(state.params):
        assert leaf.sharding.spec == P()
    assert rt.model.report.replicated_fraction == 1.0


def test_channel_rule_override_shards_weights_and_still_matches(config, reference):
    """mesh.rules.channels=tensor on top of `spatial`: weights split along their channels."""
    rt = runtime(config, jax.devices(), "mesh.strategy=spatial", "mesh.axes.context=4",
                 "mesh.axes.tensor=2", "mesh.rules.channels=tensor", "mesh.rules.y=null")
    losses, state = train_steps(rt, STEPS)
    np.testing.assert_allclose(losses, reference, rtol=1e-4)
    params = state.params
    spectral = params["layers"][0]["spectral"]["weight_real"]
    assert spectral.sharding.spec == P(None, None, "tensor")
    assert params["layers"][0]["pointwise"]["bias"].sharding.spec == P("tensor")
    assert params["output"]["kernel"].sharding.spec == P("tensor")
    specs = activation_specs(rt, state)
    assert specs["fno/layer0"] == P(None, "context", None, "tensor")
