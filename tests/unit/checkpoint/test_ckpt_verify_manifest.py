"""`spmd ckpt verify` on a damaged manifest or marker (issue 38, item 5): a truncated persistent
manifest is DAMAGED, names its step and exits 1; `spmd ckpt ls` calls it `damaged`, not
`unverified` (which is "no manifest"); a local rank copy whose marker does not read likewise.
On a copy of the checked-in checkpoint fixture, so nothing trains."""

from __future__ import annotations

import json
import shutil

import pytest

from spmd.checkpoint.listing import scan_local, scan_persistent, verify_persistent
from spmd.checkpoint.local import MARKER
from spmd.checkpoint.persistent import MANIFEST
from tests.helpers.env import REPO, clean_env, run_spmd

pytestmark = pytest.mark.slow   # `spmd ckpt` subprocesses

FIXTURE = REPO / "tests" / "fixtures" / "checkpoint_5924438"


def _copy(tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(FIXTURE, run_dir)
    return run_dir


def _truncate(path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_a_truncated_manifest_is_damaged_and_verify_exits_1_naming_the_step(tmp_path):
    run_dir = _copy(tmp_path)
    env = clean_env()
    clean = run_spmd("ckpt", "verify", str(run_dir), env=env)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    _truncate(run_dir / "checkpoints" / "4" / MANIFEST)

    verified = run_spmd("ckpt", "verify", str(run_dir), env=env)
    assert verified.returncode == 1, verified.stdout + verified.stderr
    damaged = [x for x in verified.stderr.splitlines() if x.startswith("DAMAGED:")]
    assert len(damaged) == 1, verified.stderr
    assert "persistent step 4" in damaged[0] and MANIFEST in damaged[0], damaged
    assert "1 damaged" in verified.stdout, verified.stdout

    listed = run_spmd("ckpt", "ls", str(run_dir), "--json", env=env)
    assert listed.returncode == 0, listed.stderr
    steps = {s["step"]: s for s in json.loads(listed.stdout)["persistent"]}
    assert steps[4]["state"] == "damaged" and MANIFEST in steps[4]["problem"]
    text = run_spmd("ckpt", "ls", str(run_dir), env=env).stdout
    line = [x for x in text.splitlines() if x.strip().startswith("step") and " 4 " in x
            and "files" in x][0]
    assert "damaged" in line and "unverified" not in line, text


def test_a_missing_manifest_is_unverified_and_not_damaged(tmp_path):
    run_dir = _copy(tmp_path)
    (run_dir / "checkpoints" / "4" / MANIFEST).unlink()
    assert [s.state for s in scan_persistent(run_dir / "checkpoints")] == ["unverified"]
    assert verify_persistent(run_dir / "checkpoints")[0] == []


def test_a_truncated_local_marker_is_damaged(tmp_path):
    run_dir = _copy(tmp_path)
    _truncate(run_dir / "local" / "4" / "rank00000" / MARKER)
    copies = {s.step: s.ranks[0] for s in scan_local(run_dir / "local")}
    assert copies[4].state == "damaged" and copies[2].state == "committed"
    verified = run_spmd("ckpt", "verify", str(run_dir), env=clean_env())
    assert verified.returncode == 1, verified.stdout + verified.stderr
    assert "DAMAGED: local step 4, rank 0: damaged marker" in verified.stderr, verified.stderr
