"""Real multi-process JAX under mpiexec: 2 processes x 4 devices == 1 process x 8 devices."""

from __future__ import annotations

import json

import numpy as np

from tests.helpers.env import REPO, clean_env, mpiexec_path, run_spmd

TINY = str(REPO / "configs" / "transformer_tiny.yaml")


def losses(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


def test_two_processes_match_one_process(tmp_path):
    mpiexec_path()
    common = ["mesh.strategy=fsdp_tp", "train.steps=10", "run.progress=false"]
    one = run_spmd("train", TINY, f"run.dir={tmp_path / 'one'}", *common,
                   env=clean_env(JAX_NUM_CPU_DEVICES="8"))
    assert one.returncode == 0, one.stderr
    two = run_spmd("run", "-n", "2", TINY, f"run.dir={tmp_path / 'two'}", *common,
                   env=clean_env(JAX_NUM_CPU_DEVICES="4"), timeout=300)
    assert two.returncode == 0, two.stdout + two.stderr
    np.testing.assert_allclose(losses(tmp_path / "two"), losses(tmp_path / "one"), rtol=1e-4)
    events = [json.loads(line) for line in (tmp_path / "two" / "events.jsonl").open()]
    started = [e for e in events if e["event"] == "started"]
    assert sorted(e["rank"] for e in started) == [0, 1]
    assert all(e["size"] == 2 for e in started)
    # each local process stands for a node: two nodes
    assert sorted(e["node"] for e in started) == [0, 1]
    assert (tmp_path / "two" / "logs" / "rank00001.log").exists()
