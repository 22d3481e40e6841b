"""Unannotated parameters train (issue 36): a parameter with no logical axes is replicated
under dp/tp/sp/spatial, placed by auto-FSDP under fsdp/fsdp_tp, marked in the report and
counted in one log line; `mesh.require_annotations: true` refuses it."""

from __future__ import annotations

import json
import logging

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from spmd.config.schema import MeshConfig
from spmd.engine.axis_rules import axis_rules, warn_replication
from spmd.engine.mesh import build_mesh
from spmd.sharding import ShardingError, ShardingReport, resolve_params, rules_for, with_axes
from spmd.sharding.report import unannotated_note
from tests.helpers.plain_models import PlainConvNet, PlainConvTask
from tests.helpers.training import config_losses, shardings_json

CONV = {"task": "tests.helpers.plain_models:PlainConvTask", "model": {"width": 32, "grid": 16},
        "train": {"steps": 4, "batch_size": 8}, "optimizer": {"lr": 0.01},
        "run": {"progress": False, "plots": False},
        "mesh": {"fsdp_min_bytes": 1024}}
STEPS = 4


def plain_state():
    with nnx.use_eager_sharding(False):
        return nnx.state(nnx.eval_shape(lambda: PlainConvNet(32, rngs=nnx.Rngs(0))), nnx.Param)


def resolved(strategy, min_bytes=1024, **axes):
    mesh = build_mesh(MeshConfig(strategy=strategy, axes=axes), jax.devices())
    rules = rules_for(strategy).with_fsdp_min_bytes(min_bytes)
    return {p.path: p for p in resolve_params(plain_state(), rules, mesh)}, mesh


@pytest.mark.parametrize("strategy", ["dp", "tp", "sp", "spatial"])
def test_unannotated_parameters_are_replicated(strategy):
    got, _ = resolved(strategy)
    assert set(got) == {f"conv{i}/{k}" for i in (1, 2, 3) for k in ("kernel", "bias")}
    for p in got.values():
        assert p.unannotated and p.logical_axes == (None,) * len(p.shape)
        assert p.spec == P() and p.auto_fsdp_dim is None


@pytest.mark.parametrize("strategy", ["fsdp", "fsdp_tp"])
def test_unannotated_parameters_are_placed_by_auto_fsdp(strategy):
    got, mesh = resolved(strategy)
    fsdp = mesh.shape["fsdp"]
    assert fsdp > 1
    kernel = got["conv2/kernel"]            # (3, 3, 32, 32): the last dimension
    assert kernel.unannotated and kernel.auto_fsdp_dim == 3
    assert kernel.spec == P(None, None, None, "fsdp")
    assert got["conv3/kernel"].auto_fsdp_dim == 2        # c_out = 1: c_in is split
    assert got["conv1/bias"].spec == P()                 # 128 B: below mesh.fsdp_min_bytes


def test_a_partly_annotated_model_mixes_both():
    class Partly(nnx.Module):
        def __init__(self, rngs):
            init = nnx.initializers.lecun_normal()
            self.named = nnx.Linear(16, 64, kernel_init=with_axes(init, ("embed", "mlp")),
                                    use_bias=False, rngs=rngs)
            self.bare = nnx.Linear(64, 16, rngs=rngs)

    with nnx.use_eager_sharding(False):
        state = nnx.state(nnx.eval_shape(lambda: Partly(nnx.Rngs(0))), nnx.Param)
    mesh = build_mesh(MeshConfig(strategy="fsdp_tp"), jax.devices())
    got = {p.path: p for p in resolve_params(state, rules_for("fsdp_tp"), mesh)}
    assert got["named/kernel"].spec == P("fsdp", "tensor") and not got["named/kernel"].unannotated
    assert got["bare/kernel"].unannotated and got["bare/kernel"].spec == P()  # below 1 MiB
    report = ShardingReport(dict(mesh.shape), list(got.values()))
    text = report.as_text()
    assert "unannotated" in text and "bare/bias" in text
    note = unannotated_note(report)
    assert note is not None and note.startswith("2 of 3 parameters")
    assert "with_axes" in note and "nnx.with_partitioning" in note and "tp" in note


def test_strict_errors_stay_for_annotated_names_without_a_rule_and_user_rules():
    class Odd(nnx.Module):
        def __init__(self, rngs):
            init = nnx.initializers.lecun_normal()
            self.lin = nnx.Linear(12, 60, kernel_init=with_axes(init, ("nameless", None)),
                                  use_bias=False, rngs=rngs)

    with nnx.use_eager_sharding(False):
        state = nnx.state(nnx.eval_shape(lambda: Odd(nnx.Rngs(0))), nnx.Param)
    mesh = build_mesh(MeshConfig(strategy="fsdp"), jax.devices())
    with pytest.raises(ShardingError, match="'nameless' has no rule"):
        resolve_params(state, rules_for("fsdp"), mesh)
    with pytest.raises(ShardingError, match="not divisible"):
        resolve_params(state, rules_for("fsdp", {"nameless": "fsdp"}), mesh)


def test_require_annotations_refuses_naming_the_path_and_the_key():
    mesh = build_mesh(MeshConfig(strategy="dp"), jax.devices()[:1])
    rules = axis_rules(MeshConfig(strategy="dp", require_annotations=True),
                       PlainConvTask.__new__(PlainConvTask))
    assert rules.require_annotations
    with pytest.raises(ShardingError) as e:
        resolve_params(plain_state(), rules, mesh)
    msg = str(e.value)
    assert "conv1/bias" in msg and "mesh.require_annotations" in msg and "with_axes" in msg


def test_training_logs_one_line_counting_them(caplog):
    got, mesh = resolved("dp")
    report = ShardingReport(dict(mesh.shape), list(got.values()))
    with caplog.at_level(logging.INFO, logger="spmd.sharding"):
        warn_replication(report, MeshConfig(strategy="dp"))
    lines = [r.getMessage() for r in caplog.records if "no logical axes" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("6 of 6 parameters"), lines


# ---------------------------------------------------------------- it trains

@pytest.fixture
def conv_config(tmp_path):
    path = tmp_path / "conv.json"
    path.write_text(json.dumps(CONV))
    return path


def conv_losses(path, strategy, devices, *overrides):
    return config_losses(path, strategy, devices, STEPS, *overrides)


@pytest.mark.slow
def test_plain_conv_net_trains_under_dp_and_fsdp_like_one_device(conv_config, capsys):
    one, _ = conv_losses(conv_config, "dp", jax.devices()[:1])
    eight, rt = conv_losses(conv_config, "fsdp", jax.devices())
    assert rt.mesh.shape["fsdp"] == 8
    np.testing.assert_allclose(eight, one, rtol=1e-5)
    assert len(set(one)) == STEPS   # it trains: every step a different loss

    fsdp = shardings_json(conv_config, capsys, "fsdp")
    dp = shardings_json(conv_config, capsys, "dp")
    assert fsdp["bytes_per_device"] <= dp["bytes_per_device"] / 4
    assert all(p["unannotated"] for p in fsdp["params"] + dp["params"])
    params = {p["path"]: p for p in fsdp["params"]}
    assert params["conv2/kernel"]["auto_fsdp_dim"] == 3


@pytest.mark.slow
def test_require_annotations_refuses_the_run(conv_config):
    with pytest.raises(ShardingError, match=r"conv1/bias.*mesh\.require_annotations"):
        conv_losses(conv_config, "dp", jax.devices()[:1], "mesh.require_annotations=true")
