"""A full node-local disk (issue 23, fault 5c): with `checkpoint.local_failure: continue` (the
default) a local-tier save that fails with ENOSPC is logged (WARNING naming rank, path and the
error), recorded as `save_failed`, and training goes on with its persistent saves; `stop`
ends the run as before."""

from __future__ import annotations

import errno
import logging
import os

import pytest

import spmd
import spmd.checkpoint.local as local_tier
from spmd.checkpoint import CheckpointError
from spmd.checkpoint.listing import scan_local, scan_persistent
from spmd.config.load import with_overrides
from tests.helpers.records import read_jsonl
from tests.helpers.training import mlp_config

pytestmark = pytest.mark.usefixtures("keep_signal_handlers")

FULL_FROM = 4   # the node-local disk is full from the save of step 4 on


@pytest.fixture
def full_disk(monkeypatch):
    """Writing a local-tier index of step >= FULL_FROM raises OSError(ENOSPC)."""
    real = local_tier.write_json_atomic

    def write(path, obj, **kw):
        if path.name == local_tier.INDEX and obj.get("step", 0) >= FULL_FROM:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real(path, obj, **kw)

    monkeypatch.setattr(local_tier, "write_json_atomic", write)


def _config(run_dir) -> dict:
    return mlp_config(run_dir, steps=6, checkpoint={"every": 2, "persistent_every": 3})


def test_a_full_local_tier_is_logged_and_training_goes_on(run_dir, full_disk, caplog):
    with caplog.at_level(logging.WARNING, logger="spmd.checkpoint"):
        assert spmd.train(_config(run_dir)) == 0
    events = read_jsonl(run_dir / "events.jsonl")
    failed = [(e["tier"], e["step"]) for e in events if e["event"] == "save_failed"]
    assert failed == [("local", 4), ("local", 6)]
    saved = [(e["tier"], e["step"]) for e in events if e["event"] == "saved"]
    assert saved == [("local", 2), ("persistent", 3), ("persistent", 6)]
    assert [s.step for s in scan_persistent(run_dir / "checkpoints") if s.state == "committed"][
        -1] == 6
    assert [s.step for s in scan_local(run_dir / "local") if s.committed] == [2]
    where = run_dir / "local" / "4" / "rank00000.tmp" / "index.json"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
                and "checkpoint.local_failure=continue" in r.getMessage()]
    assert len(warnings) == 2, warnings
    assert f"rank 0: writing step 4 to {where} failed" in warnings[0]
    assert "No space left on device" in warnings[0]


def test_local_failure_stop_ends_the_run(run_dir, full_disk):
    with pytest.raises(CheckpointError, match="step 4 was not committed to the local tier"):
        spmd.train(with_overrides(_config(run_dir), ["checkpoint.local_failure=stop"]))
    events = read_jsonl(run_dir / "events.jsonl")
    assert [(e["tier"], e["step"]) for e in events if e["event"] == "save_failed"] == [
        ("local", 4)]
    assert not [e for e in events if e["event"] == "saved" and e["step"] == 6]
