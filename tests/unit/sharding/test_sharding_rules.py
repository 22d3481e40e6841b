"""The resolver's strictness and the presets' tables, without devices."""

import pytest
from jax.sharding import PartitionSpec as P

from spmd.sharding import PRESETS, ShardingError, logical_to_spec, rules_for

MESH = {"data": 1, "stage": 1, "fsdp": 4, "context": 1, "tensor": 2, "expert": 1}


def test_fsdp_tp_kernel_spec():
    rules = rules_for("fsdp_tp")
    assert logical_to_spec(("embed", "mlp"), rules, MESH, shape=(64, 256)) == P("fsdp", "tensor")
    assert logical_to_spec(("mlp", "embed"), rules, MESH, shape=(256, 64)) == P("tensor", "fsdp")


def test_activation_rules_differ_from_parameter_rules():
    rules = rules_for("fsdp")
    act = logical_to_spec(("batch", "length", "embed"), rules, MESH, shape=(8, 4, 64),
                          activation=True)
    assert act == P("fsdp")  # embed is sharded for parameters, not for activations
    assert logical_to_spec(("embed",), rules, MESH, shape=(64,)) == P("fsdp")


def test_size_one_axes_are_dropped():
    rules = rules_for("dp")
    assert logical_to_spec(("batch", "embed"), rules, MESH, shape=(8, 64)) == P()


def test_unknown_logical_name_names_the_path():
    with pytest.raises(ShardingError, match=r"parameter blocks/0/w: logical axis 'bogus'"):
        logical_to_spec(("bogus",), rules_for("dp"), MESH, shape=(4,), path="blocks/0/w")


def test_indivisible_dimension_names_path_dim_size_and_axes():
    with pytest.raises(ShardingError) as e:
        logical_to_spec(("embed", "mlp"), rules_for("fsdp_tp"), MESH, shape=(62, 256),
                        path="mlp/up/kernel")
    msg = str(e.value)
    for part in ("mlp/up/kernel", "dimension 0", "'embed'", "size 62", "fsdp=4"):
        assert part in msg


def test_mesh_axis_used_twice_is_an_error():
    rules = rules_for("tp", {"embed": "tensor"})
    with pytest.raises(ShardingError, match="mesh axis 'tensor' is used twice"):
        logical_to_spec(("embed", "mlp"), rules, MESH, shape=(64, 256), path="k")


def test_rule_naming_missing_mesh_axis_is_an_error():
    with pytest.raises(ShardingError, match="'tensr' names a mesh axis that does not exist"):
        rules_for("tp", {"mlp": "tensr"})


def test_rank_mismatch_is_an_error():
    with pytest.raises(ShardingError, match="2 dimensions"):
        logical_to_spec(("embed",), rules_for("dp"), MESH, shape=(4, 4), path="w")


def test_every_preset_covers_the_model_vocabulary():
    names = {"batch", "length", "embed", "mlp", "heads", "kv", "vocab", "layers",
             "x", "y", "z", "channels", "modes"}
    for preset in PRESETS.values():
        assert names <= set(preset.rules), preset.name


def test_overrides_replace_single_entries():
    rules = rules_for("fsdp", {"mlp": ["tensor"], "vocab": None})
    assert rules.lookup("mlp") == ("tensor",)
    assert rules.lookup("vocab") == ()
    assert rules.lookup("embed") == ("fsdp",)


def test_with_axes_annotates_flax_layers():
    import jax
    from flax import nnx

    from spmd.config.schema import MeshConfig
    from spmd.engine.mesh import build_mesh
    from spmd.sharding import resolve_params, with_axes

    def layer():
        init = nnx.initializers.lecun_normal()
        return nnx.Linear(64, 256, rngs=nnx.Rngs(0), kernel_init=with_axes(init, ("embed", "mlp")),
                          bias_init=with_axes(nnx.initializers.zeros, ("mlp",)))

    _, params = nnx.split(nnx.eval_shape(layer), nnx.Param)
    mesh = build_mesh(MeshConfig(strategy="fsdp_tp"), jax.devices())
    specs = {p.path: p.spec for p in resolve_params(params, rules_for("fsdp_tp"), mesh)}
    assert specs == {"kernel": P("fsdp", "tensor"), "bias": P("tensor")}
