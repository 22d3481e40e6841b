"""End to end on a tiny Darcy problem: a missing dataset is made by rank 0, training logs
evaluations, and 1 process, 2 processes and 2 processes x 2 devices with the grid split
across processes (`spatial`) train to the same losses: the loader feeds every process
count the same global batches."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.helpers.env import clean_env, run_spmd
from tests.helpers.fno import tiny_config

STEPS = 6


def read(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "test_rel_l2" in r]
    return train, evals


def train_run(tmp_path, name, launcher, *overrides, env=None):
    (tmp_path / name).mkdir()
    data = tmp_path / name / "darcy.h5"            # missing: the run must make it
    config = tiny_config(tmp_path / name, data)
    result = run_spmd(*launcher, str(config), f"train.steps={STEPS}", *overrides,
                      env=env, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert data.is_file()
    return tmp_path / name / "run", result


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return train_run(tmp_path_factory.mktemp("fno_e2e"), "single", ("train",))


def test_single_process_trains_evaluates_and_plots(single):
    run_dir, result = single
    assert "making" in result.stderr
    train, evals = read(run_dir)
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    assert [r["step"] for r in evals] == [0, 2, 4, 6]  # after 0, 2, 4 and 6 updates
    assert all(np.isfinite(r["test_rel_l2"]) and r["test_rel_l2"] > 0 for r in evals)
    with np.load(run_dir / "eval_sample.npz") as sample:
        assert set(sample.files) == {"input", "truth", "prediction", "error"}
        assert sample["truth"].shape == (4, 16, 16)
        np.testing.assert_allclose(sample["prediction"] - sample["truth"], sample["error"],
                                   atol=1e-6)
    plotted = run_spmd("plot", str(run_dir))
    assert plotted.returncode == 0, plotted.stderr
    names = {p.name for p in (run_dir / "plots").iterdir()}
    assert {"loss.png", "test_error.png", "throughput.png", "samples.png"} <= names


@pytest.mark.slow
def test_two_processes_match_one(tmp_path, single):
    run_dir, _ = train_run(tmp_path, "two", ("run", "-n", "2"))
    ref_train, ref_evals = read(single[0])
    got_train, got_evals = read(run_dir)
    np.testing.assert_allclose([r["loss"] for r in got_train], [r["loss"] for r in ref_train],
                               rtol=1e-5)
    np.testing.assert_allclose([r["test_rel_l2"] for r in got_evals],
                               [r["test_rel_l2"] for r in ref_evals], rtol=1e-5)


@pytest.mark.slow
def test_grid_split_across_two_processes_matches_one(tmp_path, single):
    run_dir, _ = train_run(tmp_path, "spatial", ("run", "-n", "2"), "mesh.strategy=spatial",
                           "mesh.axes.context=4", env=clean_env(JAX_NUM_CPU_DEVICES="2"))
    ref_train, _ = read(single[0])
    got_train, _ = read(run_dir)
    np.testing.assert_allclose([r["loss"] for r in got_train], [r["loss"] for r in ref_train],
                               rtol=1e-4)


@pytest.mark.slow
def test_resume_on_another_process_count_continues_with_the_next_batch(tmp_path, single):
    """Steps 0-2 in one process with a checkpoint, steps 3-5 resumed by two processes: the
    loader's position comes back with the step, so the losses are those of the
    uninterrupted run."""
    ckpt = ("checkpoint.every=3", "checkpoint.persistent_every=3")
    run_dir, _ = train_run(tmp_path, "resumed", ("train",), "train.steps=3", *ckpt)
    config = tmp_path / "resumed" / "fno_tiny.yaml"
    result = run_spmd("run", "-n", "2", str(config), f"train.steps={STEPS}", *ckpt, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    # the console says it in words; the key=value record and Gloo's lines are not shown
    assert "restore step 3" in result.stderr and "restored step=3" not in result.stderr
    assert "[Gloo]" not in result.stdout + result.stderr
    assert "restored step=3" in (run_dir / "logs" / "rank00000.log").read_text()
    ref_train, _ = read(single[0])
    got_train, _ = read(run_dir)
    assert [r["step"] for r in got_train] == list(range(1, STEPS + 1))
    np.testing.assert_allclose([r["loss"] for r in got_train], [r["loss"] for r in ref_train],
                               rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["dp", "spatial"])
def test_main_job_config_on_two_ranks_of_four_devices(tmp_path, strategy):
    """The main job's own config on 2 x 4 devices (the common 2-node shape, scaled down):
    evaluation and its 4-example sample must not need a batch that divides the mesh."""
    from tests.helpers.env import REPO

    run_dir = tmp_path / "run"
    result = run_spmd("run", "-n", "2", str(REPO / "configs" / "fno_darcy.yaml"),
                      f"run.dir={run_dir}", f"data.path={tmp_path / 'darcy.h5'}",
                      f"mesh.strategy={strategy}", "model.grid=32", "model.modes=8",
                      "model.width=8", "model.projection=16", "data.num_train=32",
                      "data.num_test=16", "data.eval_batches=1", "train.steps=4",
                      "train.eval_every=2", "run.log_every=1", "run.progress=false",
                      "checkpoint.every=0", "checkpoint.persistent_every=0",
                      env=clean_env(JAX_NUM_CPU_DEVICES="4"), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    train, evals = read(run_dir)
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert [r["step"] for r in evals] == [0, 2, 4]
    with np.load(run_dir / "eval_sample.npz") as sample:
        assert sample["prediction"].shape == (4, 32, 32)
    assert (run_dir / "plots" / "samples.png").is_file()
    started = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    assert {e["size"] for e in started if e["event"] == "started"} == {2}
