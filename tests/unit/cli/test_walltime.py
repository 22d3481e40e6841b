"""A known allocation end time: the run saves and stops before it, with the requeue status."""

from __future__ import annotations

import json
import time

import pytest

from tests.helpers.env import REPO, clean_env, run_spmd

pytestmark = pytest.mark.slow   # trains or compiles: the full suite, not -m 'not slow'


def test_run_saves_and_stops_before_the_job_end_time(run_dir):
    end = time.time() + 25
    ckpt = ("checkpoint.every=100000", "checkpoint.persistent_every=100000")
    r = run_spmd("train", str(REPO / "configs" / "mlp_tiny.yaml"), f"run.dir={run_dir}",
                 "train.steps=100000000", "run.log_every=500", *ckpt,
                 "launch.walltime_margin_s=15",
                 env=clean_env(JAX_NUM_CPU_DEVICES="1", SPMD_JOB_END_TIME=f"{end:.0f}"),
                 timeout=120)
    stopped_at = time.time()
    assert r.returncode == 75, r.stderr[-3000:]
    assert stopped_at < end, "stopped only after the allocation had ended"
    events = [json.loads(line) for line in (run_dir / "events.jsonl").open()]
    preempted = next(e for e in events if e["event"] == "preempted")
    saves = [e for e in events if e["event"] == "saved" and e["step"] == preempted["step"]]
    assert {e["tier"] for e in saves} == {"local", "persistent"}
    assert "deadline" in preempted["reason"] or "wall" in preempted["reason"]
    # the next job resumes from that step
    again = run_spmd("train", str(REPO / "configs" / "mlp_tiny.yaml"), f"run.dir={run_dir}",
                     f"train.steps={preempted['step'] + 3}", *ckpt,
                     env=clean_env(JAX_NUM_CPU_DEVICES="1"))
    assert again.returncode == 0, again.stderr[-3000:]
    restored = [json.loads(line) for line in (run_dir / "events.jsonl").open()]
    assert any(e["event"] == "restored" and e["step"] == preempted["step"] for e in restored)
