"""A plain 2-D conv net with no sharding annotations (tests/helpers/plain_models.py) trains
on 2 ranks x 4 CPU devices under fsdp with the losses of one process on one device under dp
(issue 36): its unannotated parameters are placed by auto-FSDP. One 2-rank run, 4 steps."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from spmd.config.load import load_config
from spmd.engine.mesh import build_mesh
from tests.helpers.env import clean_env, mpiexec_path, run_spmd
from tests.helpers.training import runtime_for, train_steps

pytestmark = pytest.mark.slow

STEPS = 4
CONFIG = {"task": "tests.helpers.plain_models:PlainConvTask",
          "model": {"width": 32, "grid": 16},
          "train": {"steps": STEPS, "batch_size": 8}, "optimizer": {"lr": 0.01},
          "run": {"progress": False, "plots": False}, "mesh": {"fsdp_min_bytes": 1024}}


def test_unannotated_conv_net_on_two_ranks_matches_one_device(tmp_path):
    mpiexec_path()
    path = tmp_path / "conv.json"
    path.write_text(json.dumps(CONFIG))
    cfg = load_config(path, ["mesh.strategy=dp"])
    reference = train_steps(runtime_for(cfg, build_mesh(cfg.mesh, jax.devices()[:1])), STEPS)[0]

    run_dir = tmp_path / "fsdp"
    r = run_spmd("run", "-n", "2", str(path), f"run.dir={run_dir}", "mesh.strategy=fsdp",
                 "checkpoint.final=false", env=clean_env(JAX_NUM_CPU_DEVICES="4"), timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    got = {x["step"]: x["loss"] for x in lines if "loss" in x}
    assert sorted(got) == list(range(1, STEPS + 1))
    np.testing.assert_allclose([got[s] for s in sorted(got)], reference, rtol=1e-5)
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    assert {e["size"] for e in events if e["event"] == "started"} == {2}
    assert "have no logical axes" in (r.stdout + r.stderr)   # the one line that counts them
