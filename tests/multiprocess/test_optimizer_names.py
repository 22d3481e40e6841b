"""Every optimizer name (issue 21 item 1) trains the MLP task on 2 ranks and lowers its loss,
its state split over the devices of both ranks like the parameters (one mpiexec job builds
all six runtimes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from spmd.optim import OPTIMIZERS
from tests.helpers.checkpoint_worker import _env, _mpi
from tests.helpers.env import REPO

pytestmark = pytest.mark.slow

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "optimizer_worker.py"


def test_every_optimizer_lowers_the_mlp_loss_on_two_ranks(tmp_path):
    out = tmp_path / "report.json"
    proc = subprocess.run([*_mpi(2), sys.executable, str(WORKER), str(out)],
                          capture_output=True, text=True, env=_env(2), timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    report = json.loads(out.read_text())
    assert set(report) == set(OPTIMIZERS)
    for name, r in report.items():
        losses = r["losses"]
        assert r["processes"] == 2 and r["devices"] == 4, (name, r)
        assert losses[-1] < 0.9 * losses[0], (name, losses)
        assert r["split_state_arrays"] > 0, (name, r)


@pytest.mark.usefixtures("keep_signal_handlers")
def test_switching_optimizer_on_two_ranks_restores_the_parameters_only(tmp_path):
    """adamw on 2 ranks x 2 devices under fsdp, then sgd: refused in one line without
    checkpoint.params_only; with it, the parameters (read by both ranks from the persistent
    tier, resharded) and a fresh sgd state, training on from step 4."""
    from tests.helpers.checkpoint_worker import train
    from tests.helpers.records import read_jsonl

    run_dir = tmp_path / "run"
    ck = ("checkpoint.every=4", "checkpoint.persistent_every=4", "mesh.strategy=fsdp",
          "mesh.fsdp_min_bytes=0", "run.plots=false")  # plots: 2 s of CPU, unread
    first = train(2, run_dir, "train.steps=4", *ck, devices=2)
    assert first.returncode == 0, first.stderr[-6000:]
    sgd = ("optimizer.name=sgd", "optimizer.lr=0.01", "optimizer.momentum=0.9")
    refused = train(2, run_dir, "train.steps=8", *ck, *sgd, devices=2)
    assert refused.returncode == 2, refused.stderr[-6000:]
    assert "optimizer.name=adamw" in refused.stderr and "checkpoint.params_only=true" \
        in refused.stderr
    switched = train(2, run_dir, "train.steps=8", *ck, *sgd, "checkpoint.params_only=true",
                     devices=2)
    assert switched.returncode == 0, switched.stderr[-6000:]
    restored = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "restored"]
    assert restored[-1]["step"] == 4 and "parameters only" in restored[-1]["detail"]
    steps = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]
    assert steps == list(range(1, 9))
