"""`spmd train` end to end in one process: the run directory contract."""

from __future__ import annotations

import pytest
import yaml

from tests.helpers.env import REPO, clean_env, run_spmd
from tests.helpers.records import read_jsonl

pytestmark = pytest.mark.slow   # trains or compiles: the full suite, not -m 'not slow'


def test_train_writes_the_run_directory(run_dir):
    r = run_spmd("train", str(REPO / "configs" / "transformer_tiny.yaml"), f"run.dir={run_dir}",
                 "mesh.strategy=fsdp", "train.steps=12", "train.eval_every=6",
                 env=clean_env(JAX_NUM_CPU_DEVICES="8"))
    assert r.returncode == 0, r.stderr
    records = read_jsonl(run_dir / "metrics.jsonl")
    train = [m for m in records if "loss" in m]
    evals = [m for m in records if "eval_loss" in m]
    assert [m["step"] for m in train] == list(range(1, 13))  # updates done
    for m in train:
        assert m["step_time_s"] > 0 and m["samples_per_s"] > 0 and m["tokens_per_s"] > 0
        assert 0 <= m["input_wait_s"] < 60   # seconds this step waited for its batch
    assert train[-1]["loss"] < train[0]["loss"]
    assert [m["step"] for m in evals] == [0, 6, 12]  # after 0, 6 and 12 updates
    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert resolved["mesh"]["strategy"] == "fsdp" and resolved["train"]["steps"] == 12
    events = [e["event"] for e in read_jsonl(run_dir / "events.jsonl")]
    assert events[0] == "started" and events[-2:] == ["closed", "finished"]
    # the plots are drawn while the last save is written, before the checkpoint's close
    assert events.index("plotted") < events.index("checkpoint_summary") == len(events) - 3
    assert (run_dir / "plots" / "loss.png").stat().st_size > 1000
    assert (run_dir / "logs" / "rank00000.log").read_text().count("finished") == 1
    assert "step 12/12" in r.stderr  # rank-0 progress
    assert r.stderr.count("finished at step 12") == 1  # no library handler doubles the log
    assert "finished step=12" not in r.stderr   # the event's key=value record: the rank log's


def test_mlp_trains(run_dir):
    r = run_spmd("train", str(REPO / "configs" / "mlp_tiny.yaml"), f"run.dir={run_dir}",
                 "mesh.strategy=fsdp_tp", "train.steps=30", "run.plots=false",  # losses alone
                 env=clean_env(JAX_NUM_CPU_DEVICES="8"))
    assert r.returncode == 0, r.stderr
    losses = [m["loss"] for m in read_jsonl(run_dir / "metrics.jsonl")]
    assert len(losses) == 30 and losses[-1] < 0.7 * losses[0]


def test_compilation_cache_is_filled_and_reused_by_a_resumed_run(run_dir, tmp_path):
    cache = tmp_path / "xla-cache"
    common = [str(REPO / "configs" / "mlp_tiny.yaml"), f"run.dir={run_dir}",
              f"run.compilation_cache={cache}", "run.plots=false", "checkpoint.every=2"]
    env = clean_env(JAX_NUM_CPU_DEVICES="8")
    r = run_spmd("train", *common, "train.steps=4", env=env)
    assert r.returncode == 0, r.stderr
    assert f"compilation cache {cache}" in r.stderr
    entries = {p.name for p in cache.iterdir()}
    assert any(name.startswith("jit_train_step") for name in entries), entries
    r = run_spmd("train", *common, "train.steps=8", env=env)   # resumes at step 4
    assert r.returncode == 0, r.stderr
    assert {p.name for p in cache.iterdir()} >= entries
    events = [e["event"] for e in read_jsonl(run_dir / "events.jsonl")]
    assert "restored" in events and events[-1] == "finished"
