"""A model with dropout trains and resumes bit-identically on 2 ranks x 4 CPU devices (issue 20).

The fixture task (tests/helpers/dropout_task.py, dropout 0.1, its loss taking `rngs` and
`train`) runs under `spmd run -n 2`: once uninterrupted, once stopped at a checkpoint and
continued. Every loss and eval loss must be equal, exactly: the RNG position is a function
of the restored state and the step. The same run on one device gives the same losses (the
masks do not depend on the sharding).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from tests.helpers.env import REPO, clean_env, side_by_side
from tests.helpers.records import read_jsonl

pytestmark = pytest.mark.slow

STEPS = 6
CONFIG = {
    "task": "tests.helpers.dropout_task:DropoutTask",
    "run": {"progress": False, "plots": False, "log_every": 1},
    "model": {"d_in": 8, "d_hidden": 32, "d_out": 4, "dropout": 0.1},
    "mesh": {"strategy": "dp"},
    "train": {"steps": STEPS, "batch_size": 16, "eval_every": 3},
    "optimizer": {"lr": 3.0e-3},
    "checkpoint": {"every": 3},
}


def spmd(config: Path, run_dir: Path, *overrides: str, ranks: int = 2,
         devices: int = 4) -> None:
    head = ["run", "-n", str(ranks)] if ranks > 1 else ["train"]
    r = subprocess.run([sys.executable, "-m", "spmd.cli", *head, str(config),
                        f"run.dir={run_dir}", *overrides], capture_output=True, text=True,
                       timeout=300, cwd=REPO,
                       env=clean_env(JAX_NUM_CPU_DEVICES=str(devices),
                                     SPMD_PROCESSES_PER_NODE="1"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]


def records(run_dir: Path) -> tuple[dict[int, float], dict[int, float]]:
    """{step: loss} and {step: eval_loss} of a run's metrics.jsonl."""
    rows = read_jsonl(run_dir / "metrics.jsonl")
    return ({r["step"]: r["loss"] for r in rows if "loss" in r},
            {r["step"]: r["eval_loss"] for r in rows if "eval_loss" in r})


def test_dropout_trains_and_resumes_bit_identically_and_like_one_device(tmp_path):
    config = tmp_path / "dropout.yaml"
    config.write_text(yaml.safe_dump(CONFIG))
    whole, resumed, single = tmp_path / "whole", tmp_path / "resumed", tmp_path / "single"

    side_by_side(lambda: spmd(config, whole),          # independent runs, at once
                 lambda: spmd(config, resumed, "train.steps=3"),  # stops at step 3's checkpoint
                 lambda: spmd(config, single, ranks=1, devices=1))
    spmd(config, resumed)                                # and goes on from it

    losses, evals = records(whole)
    assert sorted(losses) == list(range(1, STEPS + 1)) and sorted(evals) == [0, 3, 6]
    restored = [e for e in read_jsonl(resumed / "events.jsonl") if e["event"] == "restored"]
    assert restored and {(e["step"], e["source"]) for e in restored} == {(3, "local")}, restored
    assert records(resumed) == (losses, evals), json.dumps(records(resumed))

    one_losses, one_evals = records(single)
    steps = sorted(losses)
    np.testing.assert_allclose([one_losses[s] for s in steps], [losses[s] for s in steps],
                               rtol=1e-5)
    np.testing.assert_allclose([one_evals[s] for s in (0, 3, 6)],
                               [evals[s] for s in (0, 3, 6)], rtol=1e-5)
