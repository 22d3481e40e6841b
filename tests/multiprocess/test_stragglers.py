"""Straggler detection in real 2-rank runs (`spmd run -n 2`): rank 1 slowed on purpose by the
test-only fault SPMD_TEST_SLOW_RANK is named (events.jsonl, metrics.jsonl, `spmd report`);
an even run names no one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.helpers.checkpoint_worker import events, train
from tests.helpers.env import require, run_spmd
from tests.helpers.fault_injection import fault_env
from tests.helpers.records import read_jsonl

pytestmark = pytest.mark.slow

STEPS, LOG_EVERY, SLOW_S = 40, 5, 0.05
RUN = (f"train.steps={STEPS}", f"run.log_every={LOG_EVERY}", "run.plots=false",
       "checkpoint.every=0")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Two 2-rank runs, one after the other (timings of one would disturb the other's)."""
    require(shutil.which("mpiexec") is not None, "mpiexec (pip install 'spmd-hpc[local]')")
    root = tmp_path_factory.mktemp("stragglers")
    out = {}
    for name, faults in (("slowed", fault_env(slow_rank=f"1:{SLOW_S}")), ("even", {})):
        proc = train(2, root / name, *RUN, devices=1, **faults)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
        out[name] = root / name
    return out


def train_records(run_dir: Path) -> list[dict]:
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]


def test_the_slowed_rank_is_named_with_its_host(runs):
    run_dir = runs["slowed"]
    named = events(run_dir, "straggler")
    assert named, "no straggler event"
    started = {e["rank"]: e["host"] for e in events(run_dir, "started")}
    (event,) = named                       # one streak, named once, by rank 0
    assert event["rank"] == 1 and event["host"] == started[1]
    assert event["host_step_s"] > SLOW_S > event["median_s"] and event["factor"] > 1.3
    # named at the third slow check after the warm-up check (step 5): 10, 15, 20
    assert event["step"] == 4 * LOG_EVERY
    records = {r["step"]: r for r in train_records(run_dir)}
    for step in range(2 * LOG_EVERY, STEPS + 1, LOG_EVERY):   # after warm-up
        r = records[step]
        assert r["slowest_rank"] == 1 and r["slowest_host"] == started[1]
        assert r["host_step_s_min"] <= r["host_step_s_median"] <= r["host_step_s_max"]
        assert r["host_step_s_max"] >= SLOW_S
    assert "slowest_rank" not in records[LOG_EVERY]           # the warm-up check
    logs = (run_dir / "logs" / "rank00000.log").read_text()
    assert "WARNING spmd.loop.stragglers: straggler: rank 1 on" in logs
    report = run_spmd("report", str(run_dir), "--json")
    assert report.returncode == 0, report.stderr
    (listed,) = json.loads(report.stdout)["stragglers"]
    assert (listed["rank"], listed["host"], listed["steps"]) == (1, started[1], [20])


def test_an_even_run_names_no_one(runs):
    run_dir = runs["even"]
    assert events(run_dir, "straggler") == []
    logged = [r for r in train_records(run_dir) if "slowest_rank" in r]
    assert [r["step"] for r in logged] == list(range(2 * LOG_EVERY, STEPS + 1, LOG_EVERY))
    assert all(r["host_step_s_max"] < SLOW_S for r in logged)
    text = run_spmd("report", str(run_dir))
    assert text.returncode == 0 and "stragglers: none named" in text.stdout, text.stderr
