"""Advice that works (issue 38, item 4): the NaN stop says "set train.nonfinite=skip and run
again"; doing so resumes the run (the optimizer state is restored across the change of its
form, spmd.engine.nonfinite) and skips the bad step; switching back to `stop` resumes too.
Under `skip`, the stop after `train.max_skips` does not suggest `skip` again."""

from __future__ import annotations

import shutil

import jax
import numpy as np
import pytest

import spmd
from spmd.config.load import with_overrides
from spmd.errors import ExitCode
from tests.helpers.records import read_jsonl
from tests.unit.loop.test_nonfinite import BAD_STEP, BadBatchTask, config

pytestmark = [pytest.mark.usefixtures("keep_signal_handlers"), pytest.mark.slow]


def _stopped(run_dir) -> dict:
    return [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "stopped"][-1]


def _restored(run_dir) -> dict:
    return [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "restored"][-1]


def test_the_stop_advice_resumes_and_skips_and_switching_back_resumes(run_dir):
    # 1. stop: the bad batch of update BAD_STEP ends the run, advising train.nonfinite=skip
    assert spmd.train(config(run_dir), task=BadBatchTask) == ExitCode.NONFINITE
    reason = _stopped(run_dir)["reason"]
    assert "set train.nonfinite=skip" in reason, reason
    # 2. the advice: the same run with train.nonfinite=skip restores step BAD_STEP - 1 (saved
    # under stop) and skips the bad step
    cfg = with_overrides(config(run_dir), ["train.nonfinite=skip"])
    assert spmd.train(cfg, task=BadBatchTask) == ExitCode.OK
    assert _restored(run_dir)["step"] == BAD_STEP - 1
    records = {r["step"]: r for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r}
    assert records[BAD_STEP]["skips"] == 1 and records[BAD_STEP]["skips_in_a_row"] == 1
    assert records[6]["skips"] == 1 and np.isfinite(records[6]["loss"])
    assert spmd.load(run_dir).step == 6
    # 3. and back: stop again, on checkpoints saved under skip (from the persistent tier:
    # the local one is gone), two more steps
    shutil.rmtree(run_dir / "local")
    cfg = with_overrides(config(run_dir), ["train.nonfinite=stop", "train.steps=8"])
    assert spmd.train(cfg, task=BadBatchTask) == ExitCode.OK
    assert (_restored(run_dir)["step"], _restored(run_dir)["source"]) == (6, "persistent")
    newest = spmd.load(run_dir)
    assert newest.step == 8
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(newest.params))


def test_the_stop_under_skip_does_not_suggest_skip(run_dir):
    cfg = {**config(run_dir, nonfinite="skip", max_skips=2), "optimizer": {"lr": 1e6}}
    assert spmd.train(cfg, task=BadBatchTask) == ExitCode.NONFINITE
    reason = _stopped(run_dir)["reason"]
    assert "train.max_skips=2" in reason and "optimizer.lr" in reason
    assert "nonfinite=skip" not in reason and "raise train.max_skips" in reason, reason
