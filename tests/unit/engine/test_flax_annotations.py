"""Models written for Flax: `nnx.with_partitioning` names, Flax-style task rules and aliases,
short specs, and the warning when a layout replicates what its strategy exists to shard."""

from __future__ import annotations

import argparse
import json
import logging

import jax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from spmd.config.load import build_task, load_config
from spmd.config.schema import MeshConfig
from spmd.engine.axis_rules import axis_rules
from spmd.engine.mesh import build_mesh
from spmd.engine.state import model_layout
from spmd.sharding import ParamSharding, ShardingError, ShardingReport, resolve_params, rules_for
from spmd.sharding.annotate import annotated_axes
from spmd.sharding.report import replication_warning
from spmd.sharding.rules import flax_rules
from tests.helpers.env import REPO
from tests.helpers.training import runtime_for

FLAX_LM = {"task": "tests.helpers.flax_native:FlaxLMTask",
           "train": {"steps": 4, "batch_size": 8},
           "run": {"progress": False, "plots": False},
           "mesh": {"axis_aliases": {"model": "tensor"}}}
TINY = REPO / "configs" / "transformer_tiny.yaml"


def flax_lm(tmp_path, *overrides: str, aliases: bool = True):
    path = tmp_path / "lm.json"
    path.write_text(json.dumps(FLAX_LM if aliases else {**FLAX_LM, "mesh": {}}))
    return load_config(path, list(overrides))


def layout(cfg):
    mesh = build_mesh(cfg.mesh, jax.devices())
    task = build_task(cfg)
    return model_layout(task, cfg.train.seed, axis_rules(cfg.mesh, task), mesh).report


def specs(report: ShardingReport) -> dict[str, P]:
    return {p.path: p.spec for p in report.params}


# ---------------------------------------------------------------- reading Flax's metadata


@pytest.mark.parametrize("key", ["out_sharding", "sharding_names", "sharding"])
def test_flax_metadata_is_read_as_logical_axes(key):
    found = annotated_axes({key: ("embed", "mlp")}, (4, 8), "w")
    assert found.axes == ("embed", "mlp") and found.source == key and found.padded == 0


def test_with_axes_wins_and_partition_specs_are_read():
    found = annotated_axes({"logical_axes": ("mlp", "embed"), "out_sharding": ("a", "b")},
                           (4, 8), "w")
    assert found.axes == ("mlp", "embed") and found.source == "with_axes"
    assert annotated_axes({"out_sharding": P("embed", None)}, (4, 8), "w").axes == ("embed", None)
    assert annotated_axes({"eager_sharding": False}, (4,), "w") is None


def test_short_flax_spec_is_padded_at_the_end():
    found = annotated_axes({"out_sharding": ("mlp",)}, (4, 8, 2), "w")
    assert found.axes == ("mlp", None, None) and found.padded == 2
    assert annotated_axes({"out_sharding": ()}, (4,), "w").axes == (None,)


def test_physical_or_nested_flax_shardings_are_refused():
    mesh = jax.make_mesh((1,), ("x",), devices=jax.devices()[:1])
    with pytest.raises(ShardingError, match="layers/w: Flax annotation out_sharding"):
        annotated_axes({"out_sharding": NamedSharding(mesh, P("x"))}, (4,), "layers/w")
    with pytest.raises(ShardingError, match="one logical name"):
        annotated_axes({"out_sharding": (("embed", "mlp"),)}, (4,), "w")


def test_flax_annotated_layers_resolve_like_with_axes():
    def build():
        return nnx.Linear(64, 16, rngs=nnx.Rngs(0),
                          kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(),
                                                            ("embed", "mlp")),
                          bias_init=nnx.with_partitioning(nnx.initializers.zeros, ()))
    with nnx.use_eager_sharding(False):
        state = nnx.state(nnx.eval_shape(build), nnx.Param)
    mesh = build_mesh(MeshConfig(strategy="fsdp_tp"), jax.devices())
    got = {p.path: p for p in resolve_params(state, rules_for("fsdp_tp"), mesh)}
    assert got["kernel"].spec == P("fsdp", "tensor") and got["kernel"].padded == 0
    assert got["bias"].logical_axes == (None,) and got["bias"].padded == 1


def test_unannotated_parameter_error_names_both_ways_and_the_path():
    """Only with mesh.require_annotations: by default it is replicated (test_unannotated)."""
    with nnx.use_eager_sharding(False):
        state = nnx.state(nnx.eval_shape(
            lambda: nnx.Sequential(nnx.Linear(4, 8, rngs=nnx.Rngs(0)))), nnx.Param)
    mesh = build_mesh(MeshConfig(strategy="dp"), jax.devices())
    with pytest.raises(ShardingError) as e:
        resolve_params(state, rules_for("dp").with_require_annotations(True), mesh)
    msg = str(e.value)
    for part in ("layers/0/bias", "no logical axes", "with_axes", "nnx.with_partitioning",
                 "mesh.require_annotations"):
        assert part in msg, msg


# ---------------------------------------------------------------- task rules and aliases


def test_flax_rules_map_aliases_and_the_first_rule_wins():
    rules = flax_rules([("mlp", "model"), ("mlp", None), ("batch", ("data", "model")),
                        ("kv", None), ("embed", "fsdp"), ("heads", "gone")],
                       {"model": "tensor", "gone": None})
    assert rules == {"mlp": ("tensor",), "batch": ("data", "tensor"), "kv": (),
                     "embed": ("fsdp",), "heads": ()}


def test_unknown_mesh_axis_in_task_rules_names_the_rule_and_axis_aliases():
    with pytest.raises(ShardingError) as e:
        flax_rules([("mlp", "model")], {}, source="MyTask.logical_axis_rules()")
    msg = str(e.value)
    for part in ("MyTask.logical_axis_rules()", "('mlp', 'model')", "mesh.axis_aliases.model"):
        assert part in msg, msg
    with pytest.raises(ShardingError, match="mesh.axis_aliases.model='tensr'"):
        flax_rules([], {"model": "tensr"})
    with pytest.raises(ShardingError, match="not a"):
        flax_rules([("mlp",)], {})


class _Task:
    def __init__(self, rules):
        self.rules = rules

    def logical_axis_rules(self):
        return self.rules


def test_precedence_preset_then_task_then_config():
    task = _Task([("embed", None), ("mlp", "model"), ("heads", "model"), ("extra", "model")])
    cfg = MeshConfig(strategy="fsdp", axis_aliases={"model": "tensor"},
                     rules={"heads": None}, fsdp_min_bytes=123)
    table = axis_rules(cfg, task)
    assert table.lookup("embed") == ()            # task over preset (fsdp)
    assert table.lookup("mlp") == ("tensor",)     # task adds, through the alias
    assert table.lookup("heads") == ()            # config over task
    assert table.lookup("extra") == ("tensor",)   # a name only the task knows
    assert table.lookup("batch") == ("data", "fsdp")   # untouched preset entries stay
    assert table.fsdp_min_bytes == 123
    assert axis_rules(MeshConfig(), _Task(None)).lookup("embed") == ()   # no task rules
    with pytest.raises(ShardingError, match="mesh.axis_aliases"):
        axis_rules(MeshConfig(), _Task([("mlp", "model")]))


# ---------------------------------------------------------------- the Flax-native Transformer


def test_flax_lm_layout_under_fsdp_tp_with_aliases(tmp_path):
    report = layout(flax_lm(tmp_path, "mesh.strategy=fsdp_tp"))
    got = specs(report)
    assert got["blocks/0/attn/query/kernel"] == P("fsdp", "tensor")    # embed, heads, kv
    assert got["blocks/0/attn/out/kernel"] == P("tensor", None, "fsdp")
    assert got["blocks/0/mlp/up/kernel"] == P("fsdp", "tensor")        # 'mlp' -> model -> tensor
    assert got["blocks/0/mlp/down/kernel"] == P("tensor")              # short spec ('mlp',)
    assert got["embed/embedding"] == P("tensor", "fsdp")
    down = next(p for p in report.params if p.path == "blocks/0/mlp/down/kernel")
    assert down.padded == 1 and down.logical_axes == ("mlp", None)
    as_json = {p["path"]: p for p in report.as_json()["params"]}
    assert as_json["blocks/0/mlp/down/kernel"]["padded_dims"] == 1
    assert as_json["blocks/0/mlp/up/kernel"]["padded_dims"] == 0
    text = report.as_text()
    assert "padded+1" in text and "short Flax spec" in text


def test_flax_lm_without_aliases_is_a_clear_error(tmp_path):
    cfg = flax_lm(tmp_path, "mesh.strategy=tp", aliases=False)
    with pytest.raises(ShardingError, match="FlaxLMTask.logical_axis_rules.*'model'"):
        axis_rules(cfg.mesh, build_task(cfg))


# ---------------------------------------------------------------- no silent replication


def _report(mesh: dict, *params: ParamSharding) -> ShardingReport:
    full = {"data": 1, "stage": 1, "fsdp": 1, "context": 1, "tensor": 1, "expert": 1, **mesh}
    return ShardingReport(full, list(params))


def test_replication_warning_when_the_strategy_axis_shards_nothing():
    big = ParamSharding("emb", (1024, 512), "float32", ("vocab", "embed"), P())
    small = ParamSharding("norm", (512,), "float32", ("embed",), P())
    msg = replication_warning(_report({"fsdp": 8}, big, small), "fsdp", None)
    assert msg is not None
    for part in ("mesh.strategy=fsdp", "fsdp (8 devices)", "emb (1024, 512)", "2,097,152 B",
                 "mesh.rules.vocab=fsdp", "mesh.fsdp_min_bytes"):
        assert part in msg, msg
    assert msg.index("emb") < msg.index("norm")          # largest first
    sharded = ParamSharding("emb", (1024, 512), "float32", ("vocab", "embed"), P(None, "fsdp"))
    assert replication_warning(_report({"fsdp": 8}, sharded, small), "fsdp", None) is None
    assert replication_warning(_report({"data": 8}, big), "dp", 1) is None  # dp replicates
    assert replication_warning(_report({"fsdp": 1, "data": 8}, big), "fsdp", None) is None


def test_replication_warning_for_a_big_replicated_parameter():
    big = ParamSharding("pos", (4096, 256), "float32", ("length", "embed"), P())
    mlp = ParamSharding("up", (256, 1024), "float32", ("embed", "mlp"), P(None, "tensor"))
    report = _report({"tensor": 4, "data": 2}, big, mlp)
    msg = replication_warning(report, "tp", 2**20)
    for part in ("mesh.warn_replicated_bytes=1,048,576", "tensor=4", "pos (4096, 256)",
                 "4,194,304 B", "mesh.rules.length=tensor"):
        assert part in msg, msg
    assert replication_warning(report, "tp", None) is None
    assert replication_warning(report, "tp", 2**23) is None


def test_runtime_and_shardings_log_the_warning(tmp_path, caplog, capsys):
    from spmd.cli import shardings_cmd

    overrides = ["mesh.strategy=fsdp", "mesh.rules.embed=null", "mesh.fsdp_min_bytes=null"]
    with caplog.at_level(logging.WARNING, logger="spmd.sharding"):
        cfg = load_config(TINY, overrides)
        runtime_for(cfg, build_mesh(cfg.mesh, jax.devices()))
    [record] = [r for r in caplog.records if r.name == "spmd.sharding"]
    assert record.levelno == logging.WARNING
    assert "no parameter is split over it" in record.message
    assert "blocks/mlp/down/kernel" in record.message

    caplog.clear()
    flax_lm(tmp_path)   # writes lm.json
    args = argparse.Namespace(config=str(tmp_path / "lm.json"), devices=None, json=True,
                              overrides=["mesh.strategy=tp", "mesh.warn_replicated_bytes=2048"])
    with caplog.at_level(logging.WARNING, logger="spmd.sharding"):
        assert shardings_cmd.run(args) == 0
    json.loads(capsys.readouterr().out)
    [record] = [r for r in caplog.records if r.name == "spmd.sharding"]
    assert "pos (16, 32)" in record.message and "2,048 B" in record.message
    assert "tensor=8" in record.message
