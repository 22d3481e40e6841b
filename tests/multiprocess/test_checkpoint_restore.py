"""Restore sources and resharding with real processes: partner copies, the persistent tier,
flipped bytes, and other meshes/process counts. Every restored state is compared bit for bit.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.helpers.checkpoint_worker import dump, same_state, train

pytestmark = pytest.mark.slow

CKPT = ("train.steps=6", "checkpoint.every=3", "checkpoint.persistent_every=3",
        "checkpoint.keep=2", "checkpoint.timeout_s=60")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, dict, dict]:
    """A 2 x 4 run with local steps 3, 6 (partner copies on) and persistent steps 3, 6."""
    base = tmp_path_factory.mktemp("saved")
    run_dir = base / "run"
    proc = train(2, run_dir, *CKPT)
    assert proc.returncode == 0, proc.stderr[-6000:]
    pristine = base / "pristine"
    shutil.copytree(run_dir, pristine)
    baseline = dump(2, pristine, base / "baseline.npz", *CKPT)
    assert (baseline["step"], baseline["sources"]) == (6, ["local", "local"])
    shutil.rmtree(pristine / "local" / "6")
    shutil.rmtree(pristine / "checkpoints" / "6")
    step3 = dump(2, pristine, base / "step3.npz", *CKPT)
    assert (step3["step"], step3["sources"]) == (3, ["local", "local"])
    return run_dir, baseline, step3


def flip(path: Path, offset: int = 0) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def fallback_problems(out: Path) -> list[str]:
    events = out.with_name(out.stem + ".events0.jsonl")
    return [p for line in events.read_text().splitlines()
            for p in json.loads(line).get("problems", [])]


def copy_of(saved, tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    shutil.copytree(saved[0], run_dir)
    return run_dir


def test_one_process_local_tier_wiped_restores_from_partner(saved, tmp_path):
    run_dir = copy_of(saved, tmp_path)
    for d in (run_dir / "local").glob("*/rank00001"):
        shutil.rmtree(d)  # everything process 1 had on its node, partner copies included
    got = dump(2, run_dir, tmp_path / "d.npz", *CKPT)
    assert (got["step"], got["sources"]) == (6, ["local", "partner"])
    assert "rank 1 (held by rank 0)" in got["detail"]
    assert same_state(got, saved[1]) == []


def test_all_local_tiers_wiped_restores_from_persistent(saved, tmp_path):
    run_dir = copy_of(saved, tmp_path)
    shutil.rmtree(run_dir / "local")
    got = dump(2, run_dir, tmp_path / "d.npz", *CKPT)
    assert (got["step"], got["sources"]) == (6, ["persistent", "persistent"])
    assert same_state(got, saved[1]) == []


def test_flipped_byte_falls_back_to_partner_then_persistent(saved, tmp_path):
    run_dir = copy_of(saved, tmp_path)
    own = run_dir / "local" / "6" / "rank00000" / "shards.bin"
    flip(own, 100)
    got = dump(2, run_dir, tmp_path / "a.npz", *CKPT)
    assert (got["step"], got["sources"]) == (6, ["partner", "local"])
    assert any(str(own) in p and "crc32" in p for p in fallback_problems(tmp_path / "a.npz"))
    assert same_state(got, saved[1]) == []

    partner = run_dir / "local" / "6" / "rank00001" / "partner-rank00000.bin"
    flip(partner, 100)
    got = dump(2, run_dir, tmp_path / "b.npz", *CKPT)
    assert (got["step"], got["sources"]) == (6, ["persistent", "persistent"])
    problems = fallback_problems(tmp_path / "b.npz")
    assert any(str(own) in p for p in problems) and any(str(partner) in p for p in problems)
    assert same_state(got, saved[1]) == []


def test_damaged_persistent_step_falls_back_to_an_older_one(saved, tmp_path):
    run_dir = copy_of(saved, tmp_path)
    shutil.rmtree(run_dir / "local")
    victim = sorted((run_dir / "checkpoints" / "6").rglob("ocdbt.process_1/d/*"))[0]
    flip(victim, victim.stat().st_size // 2)
    got = dump(2, run_dir, tmp_path / "d.npz", *CKPT)
    assert (got["step"], got["sources"]) == (3, ["persistent", "persistent"])
    assert any(str(victim) in p for p in fallback_problems(tmp_path / "d.npz"))
    # saved while training went on (donating the state): still the exact step-3 state
    assert same_state(got, saved[2]) == []


@pytest.mark.parametrize("saver,reader", [
    ((2, 4, "fsdp_tp"), (1, 8, "dp")),
    ((1, 8, "dp"), (2, 4, "fsdp_tp")),
], ids=["2x4-fsdp_tp-to-1x8-dp", "1x8-dp-to-2x4-fsdp_tp"])
def test_restore_onto_another_mesh_and_process_count(tmp_path, saver, reader):
    (n, devices, strategy), (n2, devices2, strategy2) = saver, reader
    run_dir = tmp_path / "run"
    ck = ("train.steps=4", "checkpoint.every=4", "checkpoint.persistent_every=4",
          "checkpoint.timeout_s=60")
    proc = train(n, run_dir, *ck, f"mesh.strategy={strategy}", devices=devices)
    assert proc.returncode == 0, proc.stderr[-6000:]
    same = dump(n, run_dir, tmp_path / "same.npz", *ck, f"mesh.strategy={strategy}",
                devices=devices)
    assert same["sources"] == ["local"] * n          # same layout: node-local copies
    other = dump(n2, run_dir, tmp_path / "other.npz", *ck, f"mesh.strategy={strategy2}",
                 devices=devices2)
    assert other["sources"] == ["persistent"] * n2   # another layout: the global checkpoint
    assert same["step"] == other["step"] == 4
    assert same_state(same, other) == []
