"""Bring your own model: a user's package outside the repository trains like a built-in.

The project in tests/multiprocess/plugin_project is copied to tmp_path (outside the
repository) with its own `models/` and `launch/` packages, which raise if imported: spmd
must import only its own `spmd.models` / `spmd.launch`. Every run goes through the installed
`spmd` script with the user's project as the working directory.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.env import REPO, clean_env, side_by_side

PROJECT = REPO / "tests" / "multiprocess" / "plugin_project"
SPMD = Path(sys.executable).parent / "spmd"
STEPS = 8
# runs compared by their losses alone skip the final persistent save (about 1.5 s CPU each);
# test_kill_9_then_resume_is_bit_identical keeps checkpoints
NO_SAVE = ("checkpoint.final=false",)


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("user") / "project"
    shutil.copytree(PROJECT, root)
    return root


def spmd(project: Path, *args: str, devices: int = 8, timeout: float = 300,
         **env: str) -> subprocess.CompletedProcess:
    script = [str(SPMD)] if SPMD.exists() else [sys.executable, "-m", "spmd.cli"]
    return subprocess.run([*script, *args], cwd=project, capture_output=True, text=True,
                          timeout=timeout,
                          env=clean_env(JAX_NUM_CPU_DEVICES=str(devices), **env))


def losses(run_dir: Path) -> list[float]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    by_step = {r["step"]: r["loss"] for r in lines if "loss" in r}
    return [by_step[s] for s in sorted(by_step)]


@pytest.fixture(scope="module")
def one_device(project) -> list[float]:
    run_dir = project / "runs" / "one"
    r = spmd(project, "train", "heat.yaml", f"run.dir={run_dir}", *NO_SAVE, devices=1)
    assert r.returncode == 0, r.stderr
    got = losses(run_dir)
    assert len(got) == STEPS and got[-1] < got[0], got
    return got


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    ("mesh.strategy=dp",),
    ("mesh.strategy=fsdp",),
    ("mesh.strategy=spatial", "mesh.axes.context=4", "mesh.axes.tensor=2"),
], ids=["dp", "fsdp", "spatial"])
def test_plugin_trains_under_every_preset_like_one_device(project, one_device, overrides):
    run_dir = project / "runs" / overrides[0].split("=")[1]
    r = spmd(project, "train", "heat.yaml", f"run.dir={run_dir}", *NO_SAVE, *overrides)
    assert r.returncode == 0, r.stderr
    np.testing.assert_allclose(losses(run_dir), one_device, rtol=1e-4)
    resolved = (run_dir / "config.yaml").read_text()
    assert "task: heatpkg.task:HeatTask" in resolved and "width: 8" in resolved


def test_shardings_and_plan_accept_the_plugin(project):
    r = spmd(project, "shardings", "heat.yaml", "mesh.strategy=fsdp", "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    mix = next(p for p in report["params"] if p["path"] == "mix/kernel")
    assert mix["logical_axes"] == [None, None, None, "embed", "mlp"]
    assert mix["spec"][3] == "fsdp"
    r = spmd(project, "plan", "heat.yaml", "--devices", "8", "mesh.strategy=spatial",
             "mesh.axes.context=4", "mesh.axes.tensor=2", "--json")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["mesh"]["context"] == 4 and plan["mesh"]["tensor"] == 2
    assert plan["param_bytes"] > 0 and plan["temp_bytes"] > 0


@pytest.mark.slow
def test_kill_9_then_resume_is_bit_identical(project):
    common = ("heat.yaml", "train.steps=16", "checkpoint.every=4", "mesh.strategy=dp")
    reference = project / "runs" / "uninterrupted"
    run_dir = project / "runs" / "killed"

    def kill_after_step_8() -> None:
        script = [str(SPMD)] if SPMD.exists() else [sys.executable, "-m", "spmd.cli"]
        proc = subprocess.Popen([*script, "train", *common, f"run.dir={run_dir}"], cwd=project,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env=clean_env(JAX_NUM_CPU_DEVICES="8", HEAT_STEP_DELAY_S="0.2"))
        try:
            committed = run_dir / "local" / "8" / "rank00000" / "COMMITTED"
            deadline = time.time() + 240
            while time.time() < deadline and not committed.exists():
                time.sleep(0.05)
            assert committed.exists(), "no committed checkpoint of step 8 before the deadline"
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()

    # the slowed run mostly sleeps (HEAT_STEP_DELAY_S): the reference trains meanwhile
    r, _ = side_by_side(lambda: spmd(project, "train", *common, f"run.dir={reference}"),
                        kill_after_step_8)
    assert r.returncode == 0, r.stderr
    assert len(losses(run_dir)) < 16  # it really died mid-run
    r = spmd(project, "train", *common, f"run.dir={run_dir}")
    assert r.returncode == 0, r.stderr
    restored = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    assert any(e["event"] == "restored" and e["step"] >= 8 for e in restored)
    assert losses(run_dir) == losses(reference)  # bit-identical, every step


@pytest.mark.parametrize("override, expected, commands", [
    ("task=heatpkg.nope:HeatTask", "task: cannot import module 'heatpkg.nope'",
     ("train", "shardings")),
    ("task=heatpkg.task:not_a_task", "not a subclass of spmd.Task", ("train",)),
    ("model.widht=8", "unknown config key 'model.widht'; did you mean 'model.width'?",
     ("train",)),
    ("task=heatpkg.task:Missing", "module 'heatpkg.task' has no attribute 'Missing'",
     ("train",)),
    ("model.width=wide", "command line: model.width=wide: Input should be a valid integer",
     ("train", "shardings")),
], ids=["no-module", "not-a-task", "unknown-key", "no-attribute", "bad-value"])
def test_bad_task_config_is_one_line(project, override, expected, commands):
    """Each kind of bad task config, refused in one line before anything starts: a module
    that does not import, a name that is not a Task, an unknown key, a missing attribute, a
    value of the wrong type. `spmd train` meets all five; `spmd shardings` reads the config
    through the same loader, so it is checked on one task error and one schema error
    (each command costs a JAX import, about 2 s of CPU)."""
    for command in commands:
        r = spmd(project, command, "heat.yaml", override, devices=1, timeout=120)
        assert r.returncode == 2, r.stderr
        assert expected in r.stderr, r.stderr
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_python_api_trains_with_user_hooks(project, tmp_path):
    """`spmd.train(config, task=...)` from a script, with a hook every 3 steps."""
    script = tmp_path / "train_heat.py"
    script.write_text(
        "import json, sys\n"
        "import spmd\n"
        "from heatpkg.task import HeatTask\n"
        "seen = []\n"
        "def record(info):\n"
        "    seen.append((info.step, info.final, round(info.values['loss'], 6)))\n"
        "cfg = {'model': {'width': 8, 'grid': 8}, 'train': {'steps': 7, 'batch_size': 2},\n"
        "       'run': {'progress': False, 'plots': False, 'dir': sys.argv[1]}}\n"
        "code = spmd.train(cfg, task=HeatTask, hooks=[(record, 3)])\n"
        "print(json.dumps({'code': code, 'seen': seen}))\n")
    r = subprocess.run([sys.executable, str(script), str(tmp_path / "run")], cwd=project,
                       capture_output=True, text=True, timeout=300,
                       env=clean_env(JAX_NUM_CPU_DEVICES="1", PYTHONPATH=str(project)))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["code"] == 0
    assert [(s, f) for s, f, _ in out["seen"]] == [(3, False), (6, False), (7, True)]
    logged = losses(tmp_path / "run")
    assert [loss for *_, loss in out["seen"]] == [round(logged[i - 1], 6) for i in (3, 6, 7)]
