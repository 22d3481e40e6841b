"""Broken storage under two ranks (issue 23, fault 5a).

A persistent directory that exists but in which no step directory can be created used to
hang the job: rank 0 failed to create Orbax's step directory while rank 1 waited in Orbax's
barrier for `checkpoint.timeout_s`, then everything died with misleading errors and a C++
abort. Now the ranks agree before Orbax's save that rank 0 can write there, and every rank
leaves within seconds with one line naming the directory and `checkpoint.persistent_dir`.
"""

from __future__ import annotations

import re
import subprocess
import time
import uuid

import pytest

from tests.helpers.checkpoint_worker import kill_tagged, train
from tests.helpers.env import require

pytestmark = pytest.mark.slow


def test_an_unwritable_persistent_dir_stops_every_rank_at_once(tmp_path):
    run_dir = tmp_path / "run"
    root = run_dir / "checkpoints"
    root.mkdir(parents=True)           # it exists (the tier opens) but takes no new entries
    made = subprocess.run(["chattr", "+i", str(root)], capture_output=True, text=True)
    require(made.returncode == 0, f"chattr +i on {root} ({made.stderr.strip()})")
    tag = uuid.uuid4().hex
    t0 = time.monotonic()
    try:
        r = train(2, run_dir, "train.steps=6", "checkpoint.persistent_every=2", devices=1,
                  timeout=90, SPMD_TEST_TAG=tag)
    finally:
        kill_tagged(tag)
        subprocess.run(["chattr", "-i", str(root)], check=True)
    elapsed = time.monotonic() - t0
    assert r.returncode != 0, r.stderr[-3000:]
    assert elapsed < 60, f"took {elapsed:.0f} s"
    lines = [x for x in r.stderr.splitlines() if "checkpoint.persistent_dir" in x]
    assert lines and all(str(root) in x for x in lines), r.stderr[-4000:]
    want = (f"step 2 was not committed to the persistent tier: rank 0: cannot create step 2's "
            f"directory in {root} (checkpoint.persistent_dir): Operation not permitted")
    # Every rank raises the same one line, unless the other rank's failure reached it first
    # (spmd.comm.job_failure ends it at once, naming the rank whose log has the error).
    raised = {rank for rank in (0, 1)
              if any(f"ERROR spmd.loop.trainer: rank {rank} on " in x and x.endswith(want)
                     for x in lines)}
    assert raised, r.stderr[-4000:]
    for rank in {0, 1} - raised:
        (other,) = raised
        assert re.search(rf"rank {other} on \S+ failed \(CheckpointError\); ending rank {rank} "
                         rf"on \S+ with its status 2", r.stderr), r.stderr[-4000:]
    assert "Traceback" not in r.stderr, r.stderr[-4000:]
    assert "timed out" not in r.stderr, r.stderr[-4000:]
    assert not list(root.iterdir())       # Orbax never got to create anything there
