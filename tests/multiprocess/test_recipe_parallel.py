"""The training recipe (issue 21) with real ranks: gradient accumulation under dp, fsdp and tp
on 2 ranks x 4 CPU devices equals one batch, and the EMA of an fsdp run on 2 x 4 restores
onto a 1 x 8 dp mesh bit for bit (through the persistent tier, as `spmd.load` reads it).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import spmd
from spmd.checkpoint.layout import leaf_paths
from tests.helpers.checkpoint_worker import _env, _mpi, dump, train
from tests.helpers.env import REPO

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("keep_signal_handlers")]

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "recipe_worker.py"


def test_grad_accum_equals_one_batch_under_dp_fsdp_tp_on_two_ranks(tmp_path):
    out = tmp_path / "report.json"
    proc = subprocess.run([*_mpi(2), sys.executable, str(WORKER), str(out)],
                          capture_output=True, text=True, env=_env(4), timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    report = json.loads(out.read_text())
    assert set(report) == {"dp", "fsdp", "tp"}
    for strategy, r in report.items():
        assert r["processes"] == 2, r
        assert r["loss_rel"] <= 1e-5 and r["param_rel"] <= 1e-5, (strategy, r)
        assert not r["batch_moves"], (strategy, r)   # no rows reshuffled between devices
    assert report["tp"]["mesh"] == {"data": 2, "tensor": 4}


def test_ema_of_a_2x4_fsdp_run_restores_onto_1x8_dp(tmp_path):
    run_dir = tmp_path / "run"
    ck = ("train.steps=4", "checkpoint.every=4", "checkpoint.persistent_every=4",
          "checkpoint.timeout_s=60", "train.ema_decay=0.9", "run.plots=false")
    proc = train(2, run_dir, *ck, "mesh.strategy=fsdp", devices=4)
    assert proc.returncode == 0, proc.stderr[-6000:]
    other = dump(1, run_dir, tmp_path / "dp.npz", *ck, "mesh.strategy=dp", devices=8)
    assert other["sources"] == ["persistent"] and other["step"] == 4
    arrays = other["arrays"]
    ema = jax.tree.map(np.asarray, jax.device_get(spmd.load(run_dir, ema=True).params))
    params = jax.tree.map(np.asarray, jax.device_get(spmd.load(run_dir, ema=False).params))
    paths = leaf_paths(ema)
    assert paths and all(f"ema/{p}" in arrays for p in paths)
    for p, e, w in zip(paths, jax.tree.leaves(ema), jax.tree.leaves(params)):
        assert arrays[f"ema/{p}"].tobytes() == e.tobytes(), p
        assert arrays[f"params/{p}"].tobytes() == w.tobytes(), p
    assert any(not np.array_equal(e, w)
               for e, w in zip(jax.tree.leaves(ema), jax.tree.leaves(params)))
