"""JAX's explicit sharding mode (issue 36 item 2): a Transformer written like Flax's Gemma
example (tests/helpers/explicit_sharding.py: a `ShardingConfig` of PartitionSpecs of mesh-axis
names, `out_sharding=P(...)` einsums, `jax.sharding.reshard`) trains under spmd by config only
(`mesh.axis_types: explicit`): an `AxisType.Explicit` mesh, the model's mesh-axis names
resolving to themselves, the steps traced under `jax.set_mesh`.

The fast tests check the mesh, the rule table, the parameter placement and the errors. The
slow ones train in this process on 8 CPU devices: losses under fsdp and fsdp_tp equal one
device's, a resume from a checkpoint is bit-identical (and resharded onto another strategy
it matches), and `spmd.load`, `spmd eval`,
`spmd predict`, `spmd export` and `spmd plan` work on the trained run.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import h5py
import jax
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import spmd
from spmd.config.load import build_task, load_config
from spmd.engine.axis_rules import axis_rules
from spmd.engine.engine_config import MeshConfig
from spmd.engine.mesh import build_mesh, is_explicit, physical_axis_rules
from spmd.engine.model_errors import ModelError
from spmd.engine.runtime import build_runtime
from spmd.engine.state import model_layout
from spmd.sharding import ShardingError, rules_for
from tests.helpers.training import config_losses

STEPS = 4
CONFIG = {"task": "tests.helpers.explicit_sharding:ExplicitLMTask",
          "train": {"steps": STEPS, "batch_size": 8}, "optimizer": {"lr": 0.01},
          "run": {"progress": False, "plots": False},
          "mesh": {"axis_types": "explicit"}}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("explicit")
    (root / "lm.json").write_text(json.dumps(CONFIG))
    return root


def config(workdir: Path, *overrides: str):
    return load_config(workdir / "lm.json", list(overrides))


# ---------------------------------------------------------------- the mesh and the rules

def test_mesh_axis_types_builds_an_explicit_mesh():
    explicit = build_mesh(MeshConfig(strategy="fsdp_tp", axis_types="explicit"), jax.devices())
    assert set(explicit.axis_types) == {AxisType.Explicit} and is_explicit(explicit)
    auto = build_mesh(MeshConfig(strategy="fsdp_tp"), jax.devices())
    assert set(auto.axis_types) == {AxisType.Auto} and not is_explicit(auto)


def test_mesh_axis_names_map_to_themselves_only_in_explicit_mode():
    table = rules_for("fsdp_tp", {"tensor": "fsdp"})      # a user's own rule for a mesh name
    explicit = physical_axis_rules(table, MeshConfig(axis_types="explicit"))
    assert explicit.lookup("fsdp") == ("fsdp",) and explicit.lookup("expert") == ("expert",)
    assert explicit.lookup("tensor") == ("fsdp",)         # the user's rule is kept
    assert explicit.lookup("embed") == ("fsdp",)          # logical names: the preset's
    assert physical_axis_rules(table, MeshConfig()).lookup("fsdp") is None


@pytest.mark.parametrize("strategy", ["fsdp", "fsdp_tp"])
def test_the_models_partition_specs_place_its_parameters(workdir, strategy):
    cfg = config(workdir, f"mesh.strategy={strategy}")
    mesh = build_mesh(cfg.mesh, jax.devices())
    task = build_task(cfg)
    layout = model_layout(task, 0, axis_rules(cfg.mesh, task), mesh)
    specs = {p.path: p.spec for p in layout.report.params}
    if strategy == "fsdp_tp":   # exactly the ShardingConfig's specs (fsdp=4, tensor=2)
        assert specs["embed/embedding"] == P("tensor", "fsdp")
        assert specs["blocks/0/attn/qkv/kernel"] == P(None, "fsdp", "tensor")
        assert specs["blocks/0/ffw/down/kernel"] == P("tensor", "fsdp")
        assert specs["norm/scale"] == P("tensor")
    else:                       # tensor has size 1: only the fsdp parts remain
        assert specs["embed/embedding"] == P(None, "fsdp")
        assert specs["norm/scale"] == P()
    assert not any(p.unannotated for p in layout.report.params)


def test_a_mesh_axis_the_mesh_lacks_is_named_with_the_fix(workdir):
    cfg = config(workdir, "mesh.strategy=fsdp_tp", "model.tp_axis=tp")   # Gemma's default
    mesh = build_mesh(cfg.mesh, jax.devices())
    task = build_task(cfg)
    with pytest.raises(ShardingError) as e:
        model_layout(task, 0, axis_rules(cfg.mesh, task), mesh)
    msg = str(e.value)
    assert "'tp'" in msg and "blocks/0/attn/out/kernel" in msg and "mesh.rules.tp=tensor" in msg
    assert "data, stage, fsdp, context, tensor, expert" in msg


def test_on_an_auto_mesh_the_framed_error_says_to_set_axis_types(workdir):
    cfg = config(workdir, "mesh.strategy=fsdp", "mesh.axis_types=auto",
                 "mesh.rules.fsdp=fsdp", "mesh.rules.tensor=tensor")   # the attempt
    rt = build_runtime(cfg.engine_sections(), build_mesh(cfg.mesh, jax.devices()),
                       build_task(cfg))
    with pytest.raises(ModelError) as e:
        rt.train_step.lower(rt.state.abstract, rt.abstract_batch())
    assert "mesh.axis_types=explicit" in str(e.value)
    assert str(e.value).startswith("tracing the train step")


# ---------------------------------------------------------------- it trains

def metrics(run_dir: Path) -> dict[int, float]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in lines if "loss" in r}


@pytest.fixture(scope="module")
def reference(workdir) -> list[float]:
    """One device, dp: the losses every sharded run must match."""
    return config_losses(workdir / "lm.json", "dp", jax.devices()[:1], STEPS)[0]


@pytest.fixture(scope="module")
def trained(workdir) -> Path:
    """spmd.train under fsdp_tp on 8 devices (fsdp=4, tensor=2), saving steps 2 and 4."""
    run_dir = workdir / "fsdp_tp"
    cfg = {**CONFIG, "run": {**CONFIG["run"], "dir": str(run_dir)},
           "mesh": {**CONFIG["mesh"], "strategy": "fsdp_tp"},
           "checkpoint": {"persistent_every": 2}}
    (workdir / "fsdp_tp.json").write_text(json.dumps(cfg))
    assert spmd.train(workdir / "fsdp_tp.json") == 0
    return run_dir


@pytest.mark.slow
@pytest.mark.usefixtures("keep_signal_handlers")
def test_fsdp_tp_and_fsdp_train_like_one_device_and_resume_bit_identically(
        workdir, reference, trained):
    assert len(set(reference)) == STEPS   # it trains: a different loss every step
    full = metrics(trained)
    np.testing.assert_allclose([full[s] for s in range(1, STEPS + 1)], reference, rtol=1e-5)

    resumed = workdir / "resumed"
    shutil.copytree(trained, resumed)
    shutil.rmtree(resumed / "checkpoints" / str(STEPS))   # the newest left is step 2
    cfg = json.loads((workdir / "fsdp_tp.json").read_text())
    cfg["run"]["dir"] = str(resumed)
    assert spmd.train(cfg) == 0
    events = [json.loads(x) for x in (resumed / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "restored"] == [2]
    got = metrics(resumed)
    assert [got[s] for s in (3, 4)] == [full[s] for s in (3, 4)]   # bit for bit

    # fsdp (fsdp=8), resharded on restore: the fsdp_tp step-2 checkpoint trained on under
    # fsdp gives one device's losses too
    other = workdir / "resumed_fsdp"
    shutil.copytree(trained, other)
    shutil.rmtree(other / "checkpoints" / str(STEPS))
    cfg["run"]["dir"], cfg["mesh"]["strategy"] = str(other), "fsdp"
    assert spmd.train(cfg) == 0
    assert build_mesh(load_config(other / "config.yaml").mesh, jax.devices()).shape["fsdp"] == 8
    got = metrics(other)
    np.testing.assert_allclose([got[s] for s in (3, 4)], reference[2:], rtol=1e-5)


@pytest.mark.slow
@pytest.mark.usefixtures("keep_signal_handlers")
def test_load_eval_predict_export_and_plan_work_on_the_run(workdir, trained):
    from jax import export

    from spmd.aot.plan import make_plan
    from spmd.inference.evaluation import evaluate_split
    from spmd.inference.exporting import export_model
    from spmd.inference.loading import run_mesh
    from spmd.inference.prediction import predict_file

    loaded = spmd.load(trained)            # one device, an explicit mesh like the run's
    assert loaded.step == STEPS and is_explicit(loaded.mesh)
    tokens = (np.arange(3 * 16, dtype=np.int32).reshape(3, 16) * 5) % 64
    with jax.set_mesh(loaded.mesh):        # the model's out_sharding=P(...) needs it
        direct = np.asarray(jax.jit(lambda x: loaded.task.predict(loaded.model,
                                                                 {"inputs": x}))(tokens))
    assert direct.shape == (3, 16)

    # spmd eval, on the run's own 8-device mesh: the trained model does better than at start
    on_8 = spmd.load(trained, mesh=run_mesh(loaded.config))
    first = metrics(trained)[1]
    assert evaluate_split(on_8)["eval_loss"] < first

    # spmd predict: a file of inputs -> the same tokens as the model called directly
    with h5py.File(workdir / "inputs.h5", "w") as f:
        f["inputs"] = tokens
    predict_file(on_8, workdir / "inputs.h5", workdir / "pred.h5", batch_size=8)
    with h5py.File(workdir / "pred.h5") as f:
        assert (f[next(iter(f))][...] == direct).all()

    # spmd export: the function runs without spmd and without a mesh, any batch size
    summary = export_model(loaded, workdir / "export")
    fn = export.deserialize((summary.out_dir / "predict.jax").read_bytes())
    assert (np.asarray(fn.call(tokens)) == direct).all()
    assert np.asarray(fn.call(tokens[:1])).shape == (1, 16)

    # spmd plan: the train step compiles ahead of time on the explicit mesh
    cfg = load_config(trained / "config.yaml")
    plan = make_plan(cfg, build_mesh(cfg.mesh, jax.devices()))
    assert plan.as_json()["collectives"]


def test_a_model_written_for_auto_under_explicit_gets_a_hint_to_go_back():
    """spmd's own Transformer (an embedding gather with no out_sharding) on an explicit
    mesh: the framed error says what explicit mode asks, and mesh.axis_types=auto."""
    from spmd.config.load import load_config as load
    from tests.helpers.env import REPO

    cfg = load(REPO / "configs" / "transformer_tiny.yaml",
               ["mesh.strategy=fsdp_tp", "mesh.axis_types=explicit"])
    rt = build_runtime(cfg.engine_sections(), build_mesh(cfg.mesh, jax.devices()),
                       build_task(cfg))
    with pytest.raises(ModelError) as e:
        rt.train_step.lower(rt.state.abstract, rt.abstract_batch())
    assert "out_sharding=P(...)" in str(e.value) and "mesh.axis_types=auto" in str(e.value)
