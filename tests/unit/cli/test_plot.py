"""`spmd plot RUN_DIR`: readable PNGs from metrics.jsonl and eval_sample.npz, clear errors."""

from __future__ import annotations

import argparse
import json

import matplotlib.image
import numpy as np
import pytest

from spmd.cli.plot_cmd import run as plot_run
from spmd.errors import SpmdError
from spmd.rundir.plots import make_plots, read_metrics
from spmd.tasks.figures import plot_fields
from tests.helpers.env import run_spmd


class FieldsTask:
    """A task's own figures: the eval sample's fields (as the FNO task draws them)."""

    def plot(self, out_dir, sample):
        return [plot_fields(sample, out_dir / "samples.png")]


def fake_run(run_dir, steps=40, resumed_at=None):
    run_dir.mkdir(parents=True)
    lines = []
    for step in range(steps):
        lines.append({"step": step, "loss": 1.0 / (1 + step), "step_time_s": 0.1,
                      "samples_per_s": 150 + 10 * np.sin(step), "grad_norm": 1.0})
        if (step + 1) % 10 == 0:
            lines.append({"step": step, "eval_loss": 0.5 / (1 + step),
                          "test_rel_l2": 0.6 / (1 + step) ** 0.5})
    if resumed_at is not None:                        # a restart logs some steps again
        lines += [r for r in lines if r["step"] >= resumed_at]
    text = "\n".join(json.dumps(r) for r in lines) + "\n" + '{"step": 39, "lo'  # torn last line
    (run_dir / "metrics.jsonl").write_text(text)
    x = np.linspace(0, 1, 16)
    truth = np.sin(np.pi * x)[:, None] * np.sin(np.pi * x)[None, :]
    np.savez(run_dir / "eval_sample.npz",
             input=np.where(np.add.outer(x, x) > 1, 12.0, 3.0)[None].repeat(3, 0),
             truth=truth[None].repeat(3, 0), prediction=0.9 * truth[None].repeat(3, 0),
             error=-0.1 * truth[None].repeat(3, 0))
    return run_dir


def test_plots_are_written_and_not_blank(tmp_path):
    paths = make_plots(fake_run(tmp_path / "run"), FieldsTask())
    names = sorted(p.name for p in paths)
    assert names == ["loss.png", "samples.png", "test_error.png", "throughput.png"]
    for path in paths:
        assert path.parent == tmp_path / "run" / "plots"
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert path.stat().st_size > 10_000
        image = matplotlib.image.imread(path)
        assert image.shape[0] > 300 and image.shape[1] > 500
        assert image[..., :3].std() > 0.05                # not a blank canvas
        assert len(np.unique(image[..., :3].reshape(-1, 3), axis=0)) > 50


def test_resumed_runs_keep_one_record_per_step(tmp_path):
    train, evals = read_metrics(fake_run(tmp_path / "run", resumed_at=25))
    assert [r["step"] for r in train] == list(range(40))
    assert [r["step"] for r in evals] == [9, 19, 29, 39]


def test_without_samples_or_evals_only_curves(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "loss": 2.0 - s / 10, "samples_per_s": 9.0,
                            "tokens_per_s": 900.0}) + "\n" for s in range(5)))
    names = sorted(p.name for p in make_plots(run_dir))
    assert names == ["loss.png", "throughput.png"]


def test_missing_metrics_is_a_clear_error(tmp_path):
    with pytest.raises(SpmdError, match="no metrics"):
        plot_run(argparse.Namespace(run_dir=str(tmp_path)))
    with pytest.raises(SpmdError, match="no such run directory"):
        plot_run(argparse.Namespace(run_dir=str(tmp_path / "nope")))


def test_cli_exit_status(tmp_path):
    result = run_spmd("plot", str(tmp_path))
    assert result.returncode != 0
    assert "metrics.jsonl" in result.stderr and "Traceback" not in result.stderr
    run_dir = fake_run(tmp_path / "run")
    ok = run_spmd("plot", str(run_dir))
    assert ok.returncode == 0 and "loss.png" in ok.stdout and "samples.png" not in ok.stdout
    (run_dir / "config.yaml").write_text("model: {name: fno}\n")  # the task draws the fields
    ok = run_spmd("plot", str(run_dir))
    assert ok.returncode == 0 and "samples.png" in ok.stdout
