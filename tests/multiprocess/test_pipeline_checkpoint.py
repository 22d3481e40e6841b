"""Issue 13: a checkpoint saved under `pp` (2 ranks x 4 devices) restores under `dp` (1 x 8),
and the reverse, bit for bit through the persistent tier: the stacked block parameters keep
their global shapes, only their sharding over `stage` differs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.checkpoint_worker import BASE, REPO, _env, _mpi, same_state

pytestmark = pytest.mark.slow

CONFIG = REPO / "configs" / "transformer_tiny.yaml"
WORKER = REPO / "tests" / "helpers" / "checkpoint_worker.py"
COMMON = ("model.num_layers=4", "model.attention=xla", "train.steps=2", "checkpoint.every=2",
          "checkpoint.persistent_every=2", "checkpoint.timeout_s=60")
PP = ("mesh.strategy=pp", "mesh.axes.stage=4", "mesh.axes.data=2", "train.microbatches=2")
DP = ("mesh.strategy=dp",)


def _train(n: int, devices: int, run_dir: Path, *overrides: str) -> None:
    head = ["run", "-n", str(n)] if n > 1 else ["train"]
    proc = subprocess.run([sys.executable, "-m", "spmd.cli", *head, str(CONFIG),
                           f"run.dir={run_dir}", *BASE, *COMMON, *overrides],
                          capture_output=True, text=True, env=_env(devices), timeout=400,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-6000:]


def _dump(n: int, devices: int, run_dir: Path, out: Path, *overrides: str) -> dict:
    import json

    import numpy as np

    cmd = [*(_mpi(n) if n > 1 else []), sys.executable, str(WORKER), str(CONFIG), str(out),
           f"run.dir={run_dir}", *BASE, *COMMON, *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(devices), timeout=400,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    meta = json.loads(out.with_suffix(".json").read_text())
    with np.load(out) as z:
        meta["arrays"] = {k: z[k] for k in z.files}
    return meta


@pytest.mark.parametrize("saver,reader", [
    ((2, 4, PP), (1, 8, DP)),
    ((1, 8, DP), (2, 4, PP)),
], ids=["2x4-pp-to-1x8-dp", "1x8-dp-to-2x4-pp"])
def test_pp_checkpoint_restores_under_dp_and_back(tmp_path, saver, reader):
    (n, devices, overrides), (n2, devices2, overrides2) = saver, reader
    run_dir = tmp_path / "run"
    _train(n, devices, run_dir, *overrides)
    same = _dump(n, devices, run_dir, tmp_path / "same.npz", *overrides)
    assert same["sources"] == ["local"] * n
    other = _dump(n2, devices2, run_dir, tmp_path / "other.npz", *overrides2)
    assert other["sources"] == ["persistent"] * n2   # another layout: the global checkpoint
    assert same["step"] == other["step"] == 2
    assert same_state(same, other) == []
    kernels = [k for k in same["arrays"] if "blocks" in k and "up" in k and "kernel" in k]
    assert kernels and all(same["arrays"][k].shape[0] == 4 for k in kernels)
