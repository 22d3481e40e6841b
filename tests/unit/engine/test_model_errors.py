"""Train/eval mode hooks of a Task, and errors from the user's model framed with the stage,
the task and the module path (issue 36, items 3 and 4)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from spmd.config.load import load_config
from spmd.engine.mesh import build_mesh
from spmd.engine.model_errors import ModelError, hint_for
from spmd.errors import ExitCode
from tests.helpers.training import runtime_for, train_steps

BASE = {"run": {"progress": False, "plots": False}, "train": {"steps": 2, "batch_size": 8},
        "data": {"eval_batches": 1}}


def config(tmp_path, task, **model):
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({**BASE, "task": f"tests.helpers.plain_models:{task}",
                                "model": model, "run": {**BASE["run"],
                                                        "dir": str(tmp_path / "run")}}))
    return path


def runtime(path, strategy="dp", devices=None):
    cfg = load_config(path, [f"mesh.strategy={strategy}"])
    return runtime_for(cfg, build_mesh(cfg.mesh, devices or jax.devices()[:1]))


def test_hints_for_the_known_flax_and_jax_errors():
    decode = hint_for(ValueError("No 'decode' argument was provided to MultiHeadAttention as "
                                 "either a __call__ argument, class attribute, or nnx.flag."))
    assert "train_mode" in decode and "decode=False" in decode
    assert "decode=False" in hint_for(ValueError("No `decode` argument was provided to X"))
    eager = hint_for(ValueError("An auto mesh context or metadata is required if creating a "
                                "variable with annotation out_sharding=P('vocab', 'embed')"))
    assert "nnx.use_eager_sharding(False)" in eager
    mesh = hint_for(ValueError("Using PartitionSpec when you are not under a mesh context is "
                               "not allowed."))
    assert "mesh context" in mesh and "NamedSharding" in mesh
    assert hint_for(ValueError("something else")) is None


def test_a_model_that_raises_is_framed_with_stage_task_and_module(tmp_path):
    rt = runtime(config(tmp_path, "RaisingTask", width=8, grid=8))
    with pytest.raises(ModelError) as e:
        train_steps(rt, 1)
    lines = str(e.value).splitlines()
    assert lines[0] == ("tracing the train step (Task.loss) of task RaisingTask failed in "
                        "module Exploding at conv2"), lines
    assert lines[1] == "  ValueError: boom from the model's layer"
    assert e.value.exit_code == ExitCode.USER_ERROR
    assert isinstance(e.value.__cause__, ValueError)   # the original stays chained


def test_an_error_while_building_the_model_is_framed(tmp_path):
    from spmd.engine.state import model_layout
    from spmd.sharding import rules_for
    from tests.helpers.plain_models import PlainConvTask

    class BrokenBuild(PlainConvTask):
        def build_model(self, rngs):
            raise KeyError("no such layer")

    cfg = load_config(config(tmp_path, "PlainConvTask"))
    mesh = build_mesh(cfg.mesh, jax.devices()[:1])
    with pytest.raises(ModelError) as e:
        model_layout(BrokenBuild(cfg), 0, rules_for("dp"), mesh)
    first, original = str(e.value).splitlines()[:2]
    assert first == "building the model (Task.build_model) of task BrokenBuild failed"
    assert original == "  KeyError: 'no such layer'"


def test_a_mode_flag_missing_is_framed_with_its_hint(tmp_path):
    rt = runtime(config(tmp_path, "AttentionTask"))
    with pytest.raises(ModelError) as e:
        train_steps(rt, 1)
    msg = str(e.value)
    assert msg.startswith("tracing the train step (Task.loss) of task AttentionTask failed "
                          "in module MultiHeadAttention at attn"), msg
    assert "decode` argument was provided" in msg, msg   # Flax's own message, first line
    assert "hint: the model needs the mode flag 'decode'" in msg and "train_mode" in msg


@pytest.mark.slow
def test_mode_hooks_let_the_model_train_and_evaluate(tmp_path):
    rt = runtime(config(tmp_path, "DecodeModeTask"))
    losses, state = train_steps(rt, 2)
    assert all(np.isfinite(losses)) and losses[0] != losses[1]
    batch = rt.eval_feed.global_batch(rt.task.eval_source(), 0)
    metrics = jax.device_get(rt.eval_step(rt.eval_params(state), batch))
    assert np.isfinite(metrics["eval_loss"]) and metrics["deterministic"] == 1.0  # eval mode


@pytest.mark.slow
def test_spmd_train_prints_the_framed_line_and_exits_with_the_status(tmp_path):
    path = config(tmp_path, "RaisingTask", width=8, grid=8)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.run([sys.executable, "-m", "spmd.cli", "train", str(path)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == ExitCode.USER_ERROR, proc.stderr[-3000:]
    assert ("spmd train: error: tracing the train step (Task.loss) of task RaisingTask failed "
            "in module Exploding at conv2") in proc.stderr, proc.stderr[-3000:]
    assert "ValueError: boom from the model's layer" in proc.stderr
    assert "Traceback" not in proc.stderr   # the console gets the frame, the log the traceback
    logs = "".join(p.read_text() for p in (tmp_path / "run").rglob("*.log"))
    assert "Traceback" in logs and "boom from the model's layer" in logs
