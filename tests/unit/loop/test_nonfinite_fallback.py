"""A restore that falls back to an older step saved under the other `train.nonfinite` mode
(issue 38, item 4's gap): the previous job's mode (config.yaml) names the form of the steps
it saved, not of older ones. When the newest step is lost (its node-local copy on a node the
job no longer has, its persistent step removed or damaged), the step left may hold the
other form of the optimizer state; it restores and is converted (spmd.engine.nonfinite).
Before, this failed with status 2 and Orbax's "tree structures do not match".

And a newest step saved under another mode than the previous job's (that job ended before
its first save): the run's record of each job's mode (run.dir/nonfinite_forms.json) names
its form. A guess from config.yaml would skip its node-local copies (another layout) and
restore an older step in silence."""

from __future__ import annotations

import shutil

import jax
import numpy as np
import pytest

import spmd
from spmd.errors import ExitCode
from tests.helpers.records import read_jsonl
from tests.helpers.training import mlp_config

pytestmark = [pytest.mark.usefixtures("keep_signal_handlers"), pytest.mark.slow]

CKPT = {"every": 2, "persistent_every": 2, "keep": 10}


def job(run_dir, steps: int, nonfinite: str) -> int:
    return spmd.train(mlp_config(run_dir, steps=steps, train={"nonfinite": nonfinite},
                                 checkpoint=CKPT))


def restored(run_dir) -> list[int]:
    return [e["step"] for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "restored"]


def test_a_fallback_to_a_step_of_the_other_mode_restores_and_converts(run_dir):
    assert job(run_dir, 4, "stop") == ExitCode.OK      # steps 2, 4: stop's form
    assert job(run_dir, 6, "skip") == ExitCode.OK      # step 6: skip's; config.yaml: skip
    assert restored(run_dir) == [4]
    for tier in ("local", "checkpoints"):              # step 6 lost on both tiers
        shutil.rmtree(run_dir / tier / "6")
    # the same mode as the previous job, and the step left was saved under the other one
    assert job(run_dir, 8, "skip") == ExitCode.OK
    assert restored(run_dir) == [4, 4]
    # and the other way: a job under stop, whose previous job (skip) saved steps 6 and 8,
    # after those are lost too: step 4 again, in its own form this time
    for step in ("6", "8"):
        for tier in ("local", "checkpoints"):
            shutil.rmtree(run_dir / tier / step)
    assert job(run_dir, 10, "stop") == ExitCode.OK
    assert restored(run_dir) == [4, 4, 4]
    newest = spmd.load(run_dir)
    assert newest.step == 10
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(newest.params))


def test_the_newest_step_restores_in_its_recorded_form_not_the_previous_jobs(run_dir):
    assert job(run_dir, 4, "stop") == ExitCode.OK      # steps 2, 4: stop's form
    assert job(run_dir, 8, "skip") == ExitCode.OK      # 6, 8 (and persistent 8): skip's
    for step in ("6", "8"):                            # left on the local tier only
        shutil.rmtree(run_dir / "checkpoints" / step)
    # a job under stop that saves nothing (the run is at its end): config.yaml says stop
    assert job(run_dir, 8, "stop") == ExitCode.OK
    assert "nonfinite: stop" in (run_dir / "config.yaml").read_text()
    assert job(run_dir, 10, "stop") == ExitCode.OK
    # not step 4 (persistent; 6 and 8 dropped): measured so without the record
    assert restored(run_dir) == [4, 8, 8]
    assert spmd.load(run_dir).step == 10
