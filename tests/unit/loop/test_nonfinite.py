"""Non-finite values (issue 23, item 4 and fault 5b): `train.nonfinite: stop` ends the run
with status 65 and one line naming the step, loss and gradient norm, before any checkpoint of
the non-finite state (also for a learning rate that diverges, after which `spmd ckpt verify`
passes); `skip` leaves the parameters unchanged for a bad step and goes on, and stops after
`train.max_skips` bad steps in a row, also when the streak ended between two checks."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import spmd
from spmd.checkpoint.listing import (
    scan_local,
    scan_persistent,
    verify_local,
    verify_persistent,
)
from spmd.config.load import with_overrides
from spmd.errors import ExitCode
from spmd.loop.hooks import StepInfo
from spmd.tasks.regression import RegressionTask
from tests.helpers.env import REPO, clean_env, run_spmd
from tests.helpers.records import read_jsonl
from tests.helpers.training import mlp_config

pytestmark = pytest.mark.usefixtures("keep_signal_handlers")


BAD_STEP = 3  # the batch of update 3 (data step 2) holds a NaN


class BadBatch:
    """The task's own source, except for one NaN in the batch of each data step in `bad`
    (by default BAD_STEP - 1)."""

    def __init__(self, inner, bad: range = range(BAD_STEP - 1, BAD_STEP)):
        self.inner, self.bad = inner, bad

    def rows(self, step, start, stop):
        rows = self.inner.rows(step, start, stop)
        if step in self.bad and start == 0:
            first = next(iter(rows))
            rows[first] = rows[first].copy()
            rows[first].flat[0] = np.nan
        return rows


class BadBatchTask(RegressionTask):
    def train_source(self):
        return BadBatch(super().train_source())


STREAK = range(1, 4)  # the batches of updates 2, 3 and 4 hold a NaN: 3 skips in a row


class BadStreakTask(RegressionTask):
    def train_source(self):
        return BadBatch(super().train_source(), STREAK)


def config(run_dir, **train) -> dict:
    return {"task": "tests.unit.loop.test_nonfinite:BadBatchTask",
            **mlp_config(run_dir, train=train,
                         checkpoint={"every": 1, "persistent_every": 1, "keep": 10})}


def params_by_step(run_dir, cfg) -> tuple[int, dict[int, list[np.ndarray]]]:
    seen: dict[int, list[np.ndarray]] = {}

    def keep(info: StepInfo) -> None:
        seen[info.step] = [np.asarray(x) for x in jax.tree.leaves(
            jax.device_get(info.state.params))]

    return spmd.train(cfg, task=BadBatchTask, hooks=[(keep, 1)]), seen


def test_stop_ends_the_run_before_saving_the_nonfinite_state(run_dir):
    code, _ = params_by_step(run_dir, config(run_dir))
    assert code == ExitCode.NONFINITE == 65
    events = read_jsonl(run_dir / "events.jsonl")
    stopped = [e for e in events if e["event"] == "stopped"][-1]
    assert (stopped["step"], stopped["exit_code"], stopped["hook"]) == (BAD_STEP, 65,
                                                                        "nonfinite")
    assert f"at step {BAD_STEP}" in stopped["reason"] and "loss nan" in stopped["reason"]
    assert "grad_norm nan" in stopped["reason"] and "optimizer.lr" in stopped["reason"]
    saved = {(e["tier"], e["step"]) for e in events if e["event"] == "saved"}
    assert saved == {(t, s) for t in ("local", "persistent") for s in range(1, BAD_STEP)}
    assert [s.step for s in scan_local(run_dir / "local")] == [1, 2]
    assert verify_local(run_dir / "local")[0] == []
    assert verify_persistent(run_dir / "checkpoints")[0] == []
    newest = spmd.load(run_dir)
    assert newest.step == BAD_STEP - 1
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(newest.params))


def test_stop_names_the_range_when_steps_between_checks_were_not_read(run_dir):
    cfg = with_overrides(config(run_dir), ["run.log_every=5", "checkpoint.every=0",
                                          "checkpoint.persistent_every=0"])
    assert spmd.train(cfg, task=BadBatchTask) == ExitCode.NONFINITE
    stopped = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "stopped"][-1]
    assert stopped["step"] == 5 and "at a step in 1..5" in stopped["reason"]
    assert scan_persistent(run_dir / "checkpoints") == []    # not even the final save


def test_skip_leaves_the_bad_step_out_and_goes_on(run_dir):
    code, seen = params_by_step(run_dir, config(run_dir, nonfinite="skip"))
    assert code == ExitCode.OK
    assert all(a.tobytes() == b.tobytes() for a, b in zip(seen[BAD_STEP], seen[BAD_STEP - 1]))
    assert any(a.tobytes() != b.tobytes() for a, b in zip(seen[BAD_STEP + 1], seen[BAD_STEP]))
    records = {r["step"]: r for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r}
    assert [records[s]["skips"] for s in range(1, 7)] == [0, 0, 1, 1, 1, 1]
    assert records[BAD_STEP]["skips_in_a_row"] == 1
    assert records[BAD_STEP + 1]["skips_in_a_row"] == 0
    assert spmd.load(run_dir).step == 6


def test_skip_stops_after_max_skips_in_a_row(run_dir):
    cfg = {**config(run_dir, nonfinite="skip", max_skips=2), "optimizer": {"lr": 1e6}}
    code, _ = params_by_step(run_dir, cfg)
    assert code == ExitCode.NONFINITE
    stopped = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "stopped"][-1]
    assert "2 steps in a row" in stopped["reason"] and "train.max_skips=2" in stopped["reason"]
    newest = spmd.load(run_dir)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(newest.params))


def test_skip_stops_at_the_next_check_after_a_streak_that_ended_between_checks(run_dir):
    """max_skips=2, checks at steps 8 and 10 only: the 3 skips of steps 2..4 end long
    before step 8, where the current streak is 0; the longest since step 0 stops the run."""
    cfg = with_overrides(
        {**config(run_dir, nonfinite="skip", max_skips=2),
         "task": "tests.unit.loop.test_nonfinite:BadStreakTask"},
        ["train.steps=10", "run.log_every=8", "checkpoint.every=0",
         "checkpoint.persistent_every=0"])
    assert spmd.train(cfg, task=BadStreakTask) == ExitCode.NONFINITE
    events = read_jsonl(run_dir / "events.jsonl")
    stopped = [e for e in events if e["event"] == "stopped"][-1]
    assert (stopped["step"], stopped["exit_code"]) == (8, ExitCode.NONFINITE)
    assert "3 steps in a row within steps 1..8" in stopped["reason"], stopped["reason"]
    assert "train.max_skips=2" in stopped["reason"]
    records = {r["step"]: r for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r}
    assert records[8]["skips"] == 3 and records[8]["skips_in_a_row"] == 0
    assert scan_persistent(run_dir / "checkpoints") == []   # nothing of the stopping step


def test_a_diverging_learning_rate_stops_with_one_line_and_ckpt_verify_passes(tmp_path):
    """The acceptance's scenario through the CLI: `optimizer.lr=1e6` with the default
    `train.nonfinite: stop`; then `spmd ckpt verify` on the run passes and the newest
    checkpoint is finite."""
    run_dir = tmp_path / "run"
    env = clean_env(JAX_NUM_CPU_DEVICES="1")
    r = run_spmd("train", str(REPO / "configs" / "mlp_tiny.yaml"), f"run.dir={run_dir}",
                 "optimizer.lr=1e6", "train.steps=20", "checkpoint.every=1",
                 "checkpoint.persistent_every=1", "checkpoint.keep=3", "run.progress=false",
                 "run.plots=false", env=env)
    assert r.returncode == ExitCode.NONFINITE, r.stderr[-3000:]
    named = [x for x in r.stderr.splitlines() if "stopping: non-finite loss or gradient norm"
             in x]
    assert len(named) == 1, r.stderr[-3000:]
    step = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "stopped"][-1]
    assert f"at step {step['step']} (train.nonfinite=stop)" in named[0]
    assert "optimizer.lr" in named[0] and "Traceback" not in r.stderr
    verified = run_spmd("ckpt", "verify", str(run_dir), env=env)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert "NON-FINITE" not in verified.stdout + verified.stderr
    newest = spmd.load(run_dir)
    assert 0 < newest.step < step["step"]
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(newest.params))
