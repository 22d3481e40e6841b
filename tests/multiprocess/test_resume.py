"""Resume across real crashes: 2 ranks x 4 CPU devices, `kill -9` mid-save, failing disks.

One uninterrupted reference run (12 steps, local tier every 3, persistent every 6) is shared
by the module; every other run is compared with it bit for bit.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from tests.helpers.checkpoint_worker import (
    REPO,
    _env,
    events,
    kill_tagged,
    train,
    train_cmd,
    wait_for,
)
from tests.helpers.env import run_spmd
from tests.helpers.fault_injection import fault_env

pytestmark = pytest.mark.slow

# no plots at the end of a run (about 2 s of matplotlib per finished run; nothing here
# looks at them)
CKPT = ("train.steps=12", "checkpoint.every=3", "checkpoint.persistent_every=6",
        "checkpoint.keep=2", "checkpoint.timeout_s=60", "run.plots=false")


def final_blobs(run_dir: Path, step: int) -> dict[str, bytes]:
    """Every rank's local shard blob and piece checksums of `step` (the whole state, packed)."""
    out = {}
    for rank_dir in sorted((run_dir / "local" / str(step)).glob("rank?????")):
        index = json.loads((rank_dir / "index.json").read_text())
        out[rank_dir.name] = (rank_dir / "shards.bin").read_bytes()
        out[rank_dir.name + "/crc"] = json.dumps([p["crc32"] for p in index["pieces"]]).encode()
    return out


def last_loss(run_dir: Path) -> tuple[int, float]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = [x for x in lines if "loss" in x][-1]
    return last["step"], last["loss"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    proc = train(2, run_dir, *CKPT)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return run_dir


def test_kill_9_during_a_save_resumes_bit_identical(reference, tmp_path):
    run_dir = tmp_path / "run"
    tag = uuid.uuid4().hex
    proc = subprocess.Popen(train_cmd(2, run_dir, *CKPT), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO, start_new_session=True,
                            env=_env(4, SPMD_TEST_TAG=tag, **fault_env(stall="9:120")))
    tmp_index = [run_dir / "local" / "9" / f"rank{r:05d}.tmp" / "index.json" for r in (0, 1)]
    try:
        wait_for(lambda: all(p.exists() for p in tmp_index), 240,
                 "both ranks to be in the middle of saving step 9", proc)
        assert kill_tagged(tag) >= 2
    finally:
        kill_tagged(tag)
        proc.communicate(timeout=60)
    assert not list((run_dir / "local").glob("9/rank*/COMMITTED"))
    listing = json.loads(run_spmd("ckpt", "ls", str(run_dir), "--json").stdout)
    assert listing["latest"]["local"] == 6
    assert [s["committed"] for s in listing["local"] if s["step"] == 9] == [False]

    resumed = train(2, run_dir, *CKPT)
    assert resumed.returncode == 0, resumed.stderr[-6000:]
    restored = [e for e in events(run_dir, "restored")]
    assert {(e["rank"], e["step"], e["source"]) for e in restored} == {
        (0, 6, "local"), (1, 6, "local")}
    assert final_blobs(run_dir, 12) == final_blobs(reference, 12)
    assert last_loss(run_dir) == last_loss(reference)
    # the steps after 6 that the killed job logged are trained again: each step once
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [x["step"] for x in lines if "loss" in x]
    assert steps == sorted(set(steps)) and steps[-1] == 12


def test_failed_save_keeps_previous_latest_and_names_rank_and_path(reference, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    blocker = run_dir / "local" / "15" / "rank00001"
    blocker.parent.mkdir(parents=True)
    blocker.write_text("a file where rank 1's step directory must go")
    failed = train(2, run_dir, *CKPT, "train.steps=18", "checkpoint.local_failure=stop")
    assert failed.returncode != 0
    assert "step 15 was not committed to the local tier" in failed.stderr
    assert f"rank 1: writing step 15 to {blocker}" in failed.stderr
    listing = json.loads(run_spmd("ckpt", "ls", str(run_dir), "--json").stdout)
    assert listing["latest"]["local"] == 12
    assert not list((run_dir / "local").glob("15/rank*/COMMITTED"))
    failures = events(run_dir, "save_failed")
    assert failures and str(blocker) in json.dumps(failures)

    blocker.unlink()
    resumed = train(2, run_dir, *CKPT, "train.steps=15")
    assert resumed.returncode == 0, resumed.stderr[-6000:]
    assert [(e["step"], e["source"]) for e in events(run_dir, "restored")][-2:] == [
        (12, "local"), (12, "local")]
    listing = json.loads(run_spmd("ckpt", "ls", str(run_dir), "--json").stdout)
    assert listing["latest"]["local"] == 15


def test_failed_host_copy_on_one_rank_fails_the_step_on_all_at_once(reference, tmp_path):
    """Rank 1's host copy of step 15 fails (fault injection): it still takes part in the
    partner exchange, so rank 0 is told at once instead of waiting out checkpoint.timeout_s."""
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    failed = train(2, run_dir, *CKPT, "train.steps=18", "checkpoint.local_failure=stop",
                   **fault_env(fail_host_copy="15:1"))
    assert failed.returncode != 0
    assert "step 15 was not committed to the local tier" in failed.stderr
    assert "rank 1: host copy of the snapshot of step 15 failed" in failed.stderr
    assert "timed out" not in failed.stderr, failed.stderr[-3000:]
    (failure,) = [e for e in events(run_dir, "save_failed") if e["step"] == 15]
    assert not any("timed out" in err for err in failure["errors"])
    assert not list((run_dir / "local").glob("15/rank*/COMMITTED"))
    listing = json.loads(run_spmd("ckpt", "ls", str(run_dir), "--json").stdout)
    assert listing["latest"]["local"] == 12


def test_preempted_run_saves_off_schedule_and_resumes_bit_identical(reference, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "HALT").write_text("")    # the preemption flag is up from the first step
    stopped = train(2, run_dir, *CKPT)
    assert stopped.returncode == 75, stopped.stderr[-6000:]
    assert [e["step"] for e in events(run_dir, "preempted")] == [1, 1]
    saved = {(e["tier"], e["step"]) for e in events(run_dir, "saved")}
    assert saved == {("local", 1), ("persistent", 1)}   # step 1 is on no schedule: forced
    (run_dir / "HALT").unlink()
    resumed = train(2, run_dir, *CKPT)
    assert resumed.returncode == 0, resumed.stderr[-6000:]
    assert {(e["step"], e["source"]) for e in events(run_dir, "restored")} == {(1, "local")}
    assert final_blobs(run_dir, 12) == final_blobs(reference, 12)
    assert last_loss(run_dir) == last_loss(reference)


def test_retention_deletes_the_same_steps_on_every_rank_however_slow_its_listing(tmp_path):
    """Rank 1 rescans the persistent tier a second late (fault injection), as on a busy
    parallel file system. Retention's list of steps to delete is rank 0's, so rank 1 cannot
    see rank 0's deletion half done, leave a step out, and wait in another Orbax barrier than
    rank 0 for ever (seen in CI: a run hung at its last save)."""
    run_dir = tmp_path / "run"
    proc = train(2, run_dir, "train.steps=5", "checkpoint.every=0",
                 "checkpoint.persistent_every=1", "checkpoint.keep=1", devices=2, timeout=120,
                 **fault_env(slow_listing="1:1"))
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["5"]
    saved = [e for e in events(run_dir, "saved") if e["tier"] == "persistent"]
    assert [e["dropped"] for e in saved if e["rank"] == 0] == [[], [1], [2], [3], [4]]


def test_a_rerun_of_a_finished_run_says_so_and_exits_0_without_compiling(reference, tmp_path):
    """Issue 34: the restored step is train.steps, so nothing is left to train: the rerun says
    so, records its end for `spmd report`, and compiles nothing."""
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    compiled_before = len(events(run_dir, "compiled"))
    rerun = train(2, run_dir, *CKPT)
    assert rerun.returncode == 0, rerun.stderr[-6000:]
    assert (f"run.dir {run_dir} already finished at step 12 (train.steps=12): nothing to do; "
            "raise train.steps to train further") in rerun.stderr, rerun.stderr[-3000:]
    assert len(events(run_dir, "compiled")) == compiled_before
    assert "compil" not in (rerun.stdout + rerun.stderr).lower()
    assert {(e["step"], e["source"]) for e in events(run_dir, "restored")} == {(12, "local")}
    last = events(run_dir)[-1]
    assert (last["event"], last["step"]) == ("finished", 12) and "nothing to do" in last["reason"]
