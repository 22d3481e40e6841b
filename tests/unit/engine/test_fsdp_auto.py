"""FSDP for any model: parameters no rule puts on `fsdp` are split along their largest
dimension that divides (above `mesh.fsdp_min_bytes`); explicit rules win."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from spmd.config.schema import MeshConfig
from spmd.engine.mesh import build_mesh
from spmd.sharding import ShardingError, param, resolve_params, rules_for, state_shardings
from spmd.sharding.fsdp import auto_fsdp_dim, with_fsdp_on
from tests.helpers.training import config_losses, shardings_json

MESH = {"data": 1, "stage": 1, "fsdp": 8, "context": 1, "tensor": 1, "expert": 1}


def dim(shape, spec=None, axes=None, mesh=MESH, min_bytes=0, dtype="float32"):
    return auto_fsdp_dim(shape, dtype, spec or P(), axes or (None,) * len(shape), mesh,
                         min_bytes)


def test_largest_divisible_dimension_is_chosen():
    assert dim((3, 3, 3, 16, 64)) == 4
    assert dim((3, 3, 3, 64, 1)) == 3               # last layer c_out=1: c_in
    assert dim((12, 40, 7)) == 1                    # 40 divides by 8, 12 does not
    assert dim((3, 5, 7)) is None                   # nothing divides: stays replicated
    assert dim((4,)) is None                        # smaller than the fsdp size
    assert dim(()) is None


def test_ties_go_to_the_last_dimension():
    assert dim((32, 32)) == 1
    assert dim((2, 32, 32, 12, 12)) == 2


def test_dimensions_sharded_by_other_axes_and_the_layer_stack_are_skipped():
    mesh = {**MESH, "fsdp": 4, "tensor": 2, "stage": 2}
    assert dim((64, 32), P("tensor"), mesh=mesh) == 1
    assert dim((64, 32), P(None, ("tensor", "stage")), mesh=mesh) == 0
    # pp_fsdp: a stacked (layers, ...) parameter's layers dimension is on stage
    assert dim((8, 4, 4), P("stage"), ("layers", "channels", "channels"), mesh) == 2
    # scanned layers without stages: the layers dimension is never chosen either
    assert dim((16, 8, 8), P(), ("layers", None, None)) == 2
    assert dim((16, 3, 3), P(), ("layers", None, None)) is None


def test_threshold_explicit_fsdp_and_off_switches():
    assert dim((64, 64), min_bytes=64 * 64 * 4) == 1          # at least: split
    assert dim((64, 64), min_bytes=64 * 64 * 4 + 1) is None   # below: replicated
    assert dim((64, 64), min_bytes=64 * 64 * 2, dtype="bfloat16") == 1
    assert dim((64, 64), min_bytes=None) is None              # mesh.fsdp_min_bytes: null
    assert dim((64, 64), mesh={**MESH, "fsdp": 1}) is None    # no fsdp axis
    assert dim((64, 64), P("fsdp")) is None                   # a rule put it there already


def test_with_fsdp_on():
    assert with_fsdp_on(P(), 2, 1) == P(None, "fsdp")
    assert with_fsdp_on(P("tensor"), 3, 1) == P("tensor", "fsdp")


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, embed: int = 64):
        init = nnx.initializers.normal(1.0)
        self.kernel = param(rngs.params(), init, (3, 3, 3, 16, 64), (None,) * 3 + ("channels",) * 2)
        self.emb = param(rngs.params(), init, (128, embed), ("vocab", "embed"))
        self.bias = param(rngs.params(), init, (64,), ("channels",))
        self.odd = param(rngs.params(), init, (3, 5, 7), (None, None, None))


def resolved(strategy="fsdp", min_bytes=0, embed=64, **axes):
    mesh = build_mesh(MeshConfig(strategy=strategy, axes=axes), jax.devices())
    state = nnx.state(nnx.eval_shape(lambda: Net(nnx.Rngs(0), embed)), nnx.Param)
    rules = rules_for(strategy).with_fsdp_min_bytes(min_bytes)
    return {p.path: p for p in resolve_params(state, rules, mesh)}, state, rules, mesh


def test_explicit_rules_win_and_auto_choice_is_recorded():
    got, *_ = resolved(min_bytes=1024)
    assert got["emb"].spec == P(None, "fsdp") and got["emb"].auto_fsdp_dim is None  # embed rule
    assert got["kernel"].spec == P(None, None, None, None, "fsdp")
    assert got["kernel"].auto_fsdp_dim == 4
    assert got["bias"].spec == P() and got["bias"].auto_fsdp_dim is None   # 256 B < 1024
    assert got["odd"].spec == P() and got["odd"].auto_fsdp_dim is None     # nothing divides


def test_strict_divisibility_error_for_explicit_rules_stays():
    with pytest.raises(ShardingError, match=r"emb: dimension 1 \('embed'\) has size 60"):
        resolved(min_bytes=0, embed=60)


def test_auto_fsdp_is_a_pure_function_of_shapes_rules_and_mesh():
    a, state, rules, mesh = resolved(min_bytes=0)
    b, *_ = resolved(min_bytes=0)
    assert a == b
    shardings = nnx.to_flat_state(state_shardings(state, rules, mesh))
    for path, var in shardings:
        assert var.get_value().spec == a["/".join(map(str, path))].spec
    # under fsdp_tp the tensor axis takes what its rules name; auto-FSDP never reuses it
    c, *_ = resolved("fsdp_tp", min_bytes=0)
    assert c["bias"].spec == P("fsdp") and c["kernel"].spec[-1] == "fsdp"


# ---------------------------------------------------------------- a conv net trains under fsdp

CONV = {"task": "tests.helpers.flax_native:ConvTask", "model": {"width": 32, "grid": 8},
        "train": {"steps": 4, "batch_size": 8}, "optimizer": {"lr": 0.01},
        "run": {"progress": False, "plots": False},
        "mesh": {"fsdp_min_bytes": 2048}}
STEPS = 4


@pytest.fixture
def conv_config(tmp_path):
    path = tmp_path / "conv.json"
    path.write_text(json.dumps(CONV))
    return path


def conv_losses(path, strategy, devices, *overrides):
    return config_losses(path, strategy, devices, STEPS, *overrides)


@pytest.mark.slow
def test_conv_net_trains_under_fsdp_like_one_device(conv_config, capsys):
    one, _ = conv_losses(conv_config, "fsdp", jax.devices()[:1])
    eight, rt = conv_losses(conv_config, "fsdp", jax.devices())
    assert rt.mesh.shape["fsdp"] == 8
    np.testing.assert_allclose(eight, one, rtol=1e-5)
    assert len(set(one)) == STEPS   # it trains: every step a different loss

    fsdp = shardings_json(conv_config, capsys, "fsdp")
    dp = shardings_json(conv_config, capsys, "dp")
    assert fsdp["bytes_per_device"] <= dp["bytes_per_device"] / 4
    params = {p["path"]: p for p in fsdp["params"]}
    assert params["mix/kernel"]["auto_fsdp_dim"] == 4
    assert params["out/kernel"]["auto_fsdp_dim"] == 3      # c_out = 1: split c_in
    assert params["out/kernel"]["spec"] == [None, None, None, "fsdp"]
    assert params["mix/bias"]["auto_fsdp_dim"] is None     # 128 B: below the threshold
    assert all(p["auto_fsdp_dim"] is None for p in dp["params"])
