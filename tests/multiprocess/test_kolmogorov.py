"""The weather-style flagship, examples/kolmogorov, run as a user runs it: `spmd data make`
writes the multi-file Zarr trajectories, then `spmd run -n 2` trains the FNO surrogate
(a small one, to keep this test fast), rolls it out in evaluation and plots the error
against lead time. The same run resumed from its middle checkpoint (as after a job that
died there) is bit-identical to it, and `mesh.strategy=spatial` (x split over the 2
ranks) gives the losses of data parallelism. Three training launches in all (< 90 s).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.env import REPO, clean_env, mpiexec_path, run_spmd

pytestmark = pytest.mark.slow

CONFIG = "examples/kolmogorov/config.yaml"
STEPS, ROLLOUT, SPATIAL_STEPS = 30, 4, 4
SMALL = ("model.width=16", "model.modes=6", "model.layers=2", "model.projection=32",
         "model.trajectory_steps=10", f"model.rollout_steps={ROLLOUT}", "data.num_train=16",
         "data.num_test=4", "data.eval_batches=2", f"train.eval_every={STEPS // 2}",
         f"checkpoint.every={STEPS // 2}", f"checkpoint.persistent_every={STEPS // 2}",
         "run.log_every=1", "run.progress=false")


def records(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(run_dir) if "loss" in r}


def events(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines() if x]


def train(run_dir: Path, data: Path, *overrides: str):
    r = run_spmd("run", "-n", "2", CONFIG, f"run.dir={run_dir}", f"data.path={data}", *SMALL,
                 *overrides, timeout=300, cwd=REPO, env=clean_env(JAX_NUM_CPU_DEVICES="1"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    mpiexec_path()
    path = tmp_path_factory.mktemp("kolmogorov_data") / "trajectories"
    made = run_spmd("data", "make", CONFIG, f"data.path={path}", *SMALL, cwd=REPO)
    assert made.returncode == 0, made.stderr[-3000:]
    return path


@pytest.fixture(scope="module")
def trained(data, tmp_path_factory) -> Path:
    """The whole training in one go: evaluation every STEPS / 2 steps, plots at the end."""
    run_dir = tmp_path_factory.mktemp("kolmogorov_dp") / "run"
    train(run_dir, data, f"train.steps={STEPS}")
    return run_dir


@pytest.fixture(scope="module")
def resumed(trained, data, tmp_path_factory) -> Path:
    """The same run, had its job died after saving step STEPS / 2: a copy without the
    checkpoints and metrics past it, run again by the same command (no plots)."""
    run_dir = tmp_path_factory.mktemp("kolmogorov_resumed") / "run"
    shutil.copytree(trained, run_dir)
    for tier in ("checkpoints", "local"):
        shutil.rmtree(run_dir / tier / str(STEPS))
    kept = [json.dumps(r) for r in records(run_dir) if r["step"] <= STEPS // 2]
    (run_dir / "metrics.jsonl").write_text("\n".join(kept) + "\n")
    train(run_dir, data, f"train.steps={STEPS}", "run.plots=false")
    return run_dir


def test_data_make_writes_multi_file_zarr_trajectories(data):
    import zarr

    parts = sorted(p.name for p in data.iterdir() if not p.name.startswith("."))
    assert parts == [f"part-{i:03d}.zarr" for i in range(4)]
    counts = {"train": 0, "test": 0}
    for part in parts:
        group = zarr.open_group(str(data / part), mode="r")
        for split in counts:
            array = group[f"{split}/vorticity"]
            assert array.shape[1:] == (10, 32, 32, 1) and array.dtype == np.float32
            counts[split] += array.shape[0]
            w = array[...]
            assert np.isfinite(w).all() and 0.3 < float(w.std()) < 3.0   # of order one
    assert counts == {"train": 16, "test": 4}
    # spmd data info names the reader and why: the trajectories are sharded (a window reads a
    # slab of a trajectory), which zarr reads
    info = run_spmd("data", "info", CONFIG, f"data.path={data}", *SMALL, cwd=REPO)
    assert info.returncode == 0, info.stderr[-3000:]
    assert "reads input (train/vorticity: through zarr: codec ShardingCodec before the " \
           "bytes" in info.stdout, info.stdout


def test_surrogate_learns_rolls_out_and_plots(trained):
    evals = [r for r in records(trained) if "test_rel_l2" in r]
    assert [r["step"] for r in evals] == [0, STEPS // 2, STEPS]
    first, last = evals[0]["test_rel_l2"], evals[-1]["test_rel_l2"]
    assert last <= 0.5 * first, (first, last)
    leads = [f"rollout_rel_l2_{k}" for k in range(1, ROLLOUT + 1)]
    for r in evals:
        assert all(np.isfinite(r[key]) for key in leads), r
        assert r["rollout_rel_l2_1"] == pytest.approx(r["test_rel_l2"])
    assert evals[-1][leads[-1]] > evals[-1][leads[0]]       # errors grow with lead time
    # the default order, as auto chose it for 8 KiB windows (4 MiB / 8 KiB = 512 records)
    log = (trained / "logs" / "rank00000.log").read_text()
    assert "train data order: blocks of 512 consecutive records, 16 at a time" in log
    for png in ("rollout_error.png", "samples.png", "loss.png", "test_error.png"):
        path = trained / "plots" / png
        assert path.is_file() and path.stat().st_size > 10_000, path
    with np.load(trained / "eval_sample.npz") as sample:
        assert sample["lead_error"].shape == (4, ROLLOUT)
        assert sample["prediction"].shape == sample["truth"].shape == (4, 32, 32)


def test_a_resumed_run_is_bit_identical_to_the_uninterrupted_one(trained, resumed):
    restored = [e for e in events(resumed) if e["event"] == "restored"]
    assert sorted(e["rank"] for e in restored) == [0, 1]
    assert all(e["step"] == STEPS // 2 for e in restored), restored
    whole, again = losses(trained), losses(resumed)
    assert sorted(whole) == sorted(again) == list(range(1, STEPS + 1))
    assert again == whole                                    # exactly, every step
    last = [[r for r in records(run) if r["step"] == STEPS and "test_rel_l2" in r]
            for run in (trained, resumed)]
    assert len(last[1]) == 1 and last[0] == last[1]          # the same last evaluation
    blobs = [sorted((run / "local" / str(STEPS)).glob("rank*/shards.bin"))
             for run in (trained, resumed)]
    assert len(blobs[0]) == len(blobs[1]) == 2
    for a, b in zip(*blobs):
        assert a.read_bytes() == b.read_bytes(), (a, b)


def test_spatial_split_trains_with_the_losses_of_data_parallel(data, trained, tmp_path):
    run_dir = tmp_path / "spatial"
    r = train(run_dir, data, f"train.steps={SPATIAL_STEPS}", "mesh.strategy=spatial",
              "mesh.axes.context=2", "train.eval_every=0", "run.plots=false",
              "checkpoint.every=0", "checkpoint.persistent_every=0", "checkpoint.final=false")
    assert "'context': 2" in r.stdout + r.stderr
    spatial, dp = losses(run_dir), losses(trained)
    steps = list(range(1, SPATIAL_STEPS + 1))
    assert sorted(spatial) == steps
    np.testing.assert_allclose([spatial[s] for s in steps], [dp[s] for s in steps], rtol=1e-4)
    assert spatial[SPATIAL_STEPS] < spatial[1]
