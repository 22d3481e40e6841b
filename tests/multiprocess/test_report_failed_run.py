"""`spmd report` on a real run whose first job failed (issue 34's acceptance): `spmd run -n 2`
of the tiny MLP where rank 1 raises at step 3 (rank 0 is ended by that failure and writes no
end record of its own), then the next job of its chain, which trains to the end. The report
shows the first job as failed, with rank 1, its cause and its end; the gap as queue (the
second job's `started` record carries the chain its SPMD_CHAIN names); the first job's
initialisation as init."""

from __future__ import annotations

import json

import pytest

from tests.helpers.checkpoint_worker import train
from tests.helpers.env import run_spmd
from tests.helpers.fault_injection import fault_env

pytestmark = pytest.mark.slow


def test_report_shows_a_failed_first_job_with_its_rank_and_cause(tmp_path):
    run_dir = tmp_path / "run"
    # saved in the foreground: step 2 is committed before rank 1 fails at step 3 (in the
    # background, a loaded machine may not get it done by then, and the next job starts anew)
    failed = train(2, run_dir, "train.steps=8", "checkpoint.every=2", "checkpoint.async=false",
                   devices=1, timeout=180,
                   SPMD_JOB_ID="41", **fault_env(raise_in="hook:1:3"))
    assert failed.returncode == 1, failed.stderr[-3000:]
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    (record,) = [e for e in events if e["event"] == "failed"]
    assert record["rank"] == 1 and record["first"] is True and record["exit_code"] == 1
    done = train(2, run_dir, "train.steps=8", "checkpoint.every=2", devices=1, timeout=180,
                 SPMD_JOB_ID="42", SPMD_CHAIN="41")
    assert done.returncode == 0, done.stderr[-3000:]

    result = run_spmd("report", str(run_dir), "--json", "--plot")
    assert result.returncode == 0, result.stderr
    first, second = json.loads(result.stdout)["jobs"]
    assert first["reason"].startswith("failed (rank 1 on "), first["reason"]
    assert "RuntimeError: SPMD_TEST_RAISE: injected in" in first["reason"]
    assert first["exit_status"] == 1 and first["failure"]["rank"] == 1
    assert first["end"] == pytest.approx(record["time"], abs=5.0)
    assert first["end"] >= record["time"] and first["began"] == "init"
    assert first["parts"]["init"] > 0 and first["parts"]["restore"] == 0
    assert (second["job_id"], second["chain"], second["gap_before"]) == ("42", "41", "queue")
    assert second["began"] == "restore" and second["reason"] == "finished"
    assert (run_dir / "plots" / "timeline.png").stat().st_size > 0

    text = run_spmd("report", str(run_dir))
    assert text.returncode == 0, text.stderr
    assert "failed (rank 1 on" in text.stdout and "lost (no end record" not in text.stdout
    assert "job 0 failed at" in text.stdout and "SPMD_TEST_RAISE" in text.stdout
    assert "0->1" in text.stdout and " s queue" in text.stdout
