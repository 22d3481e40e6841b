"""A resumed run's metrics (issue 23, fault 5d): after `kill -9` and a resume from step S the
steps after S are logged again; `drop_records_after` moves the first incarnation's records of
them aside (nothing lost), and the plots read one record per step (the last) regardless."""

from __future__ import annotations

import json

from spmd.rundir.metrics import JsonlWriter, drop_records_after, replayed_path
from spmd.rundir.plots import read_metrics


def _write(path, records, tail: str = "") -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)


def _steps(path) -> list:
    return [json.loads(x).get("step") for x in path.read_text().splitlines() if x.strip()]


def test_drop_records_after_moves_the_replayed_steps_aside(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    records = [{"step": s, "loss": 1.0 / s} for s in range(1, 8)]
    records.insert(3, {"step": 3, "eval_loss": 0.5})
    records.insert(0, {"note": "no step"})
    _write(metrics, records, tail='{"step": 8, "lo')        # the line a kill -9 cut short
    assert drop_records_after(metrics, 4) == 4               # steps 5, 6, 7 and the torn line
    assert _steps(metrics) == [None, 1, 2, 3, 3, 4]
    replayed = replayed_path(metrics)
    assert replayed == tmp_path / "metrics.replayed.jsonl"
    lines = replayed.read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines[:3]] == [5, 6, 7] and lines[3] == '{"step": 8, "lo'
    # the resumed run appends after the kept records, on a line of its own
    writer = JsonlWriter(metrics)
    writer.write({"step": 5, "loss": 0.3})
    writer.close()
    assert _steps(metrics)[-2:] == [4, 5]
    # a second resume appends to the replayed file; nothing to drop leaves the file alone
    assert drop_records_after(metrics, 4) == 1
    assert len(replayed.read_text().splitlines()) == 5
    before = metrics.stat().st_mtime_ns, metrics.read_bytes()
    assert drop_records_after(metrics, 4) == 0
    assert (metrics.stat().st_mtime_ns, metrics.read_bytes()) == before
    assert drop_records_after(tmp_path / "absent.jsonl", 0) == 0
    assert not list(tmp_path.glob(".*.tmp"))


def test_plots_read_the_last_record_of_a_step_logged_twice(tmp_path):
    _write(tmp_path / "metrics.jsonl", [
        {"step": 1, "loss": 4.0}, {"step": 2, "loss": 3.0}, {"step": 2, "eval_loss": 9.0},
        {"step": 2, "loss": 2.5}, {"step": 3, "loss": 2.0}, {"step": 2, "eval_loss": 8.0}])
    train, evals = read_metrics(tmp_path)
    assert [(r["step"], r["loss"]) for r in train] == [(1, 4.0), (2, 2.5), (3, 2.0)]
    assert [(r["step"], r["eval_loss"]) for r in evals] == [(2, 8.0)]
