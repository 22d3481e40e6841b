"""Restore sources and resharding with real processes: partner copies, the persistent tier,
flipped bytes, and other meshes/process counts. Every restored state is compared bit for bit.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers.checkpoint_worker import dump, dump_each, same_state, train

pytestmark = pytest.mark.slow

# no plots at the end of a run: about 2 s of matplotlib per finished run, looked at by nothing
CKPT = ("train.steps=6", "checkpoint.every=3", "checkpoint.persistent_every=3",
        "checkpoint.keep=2", "checkpoint.timeout_s=60", "run.plots=false")


def flip(path: Path, offset: int = 0) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def own_blob(run_dir: Path) -> Path:
    return run_dir / "local" / "6" / "rank00000" / "shards.bin"


def partner_blob(run_dir: Path) -> Path:
    """Rank 0's step-6 copy held by rank 1."""
    return run_dir / "local" / "6" / "rank00001" / "partner-rank00000.bin"


def persistent_victim(run_dir: Path) -> Path:
    return sorted((run_dir / "checkpoints" / "6").rglob("ocdbt.process_1/d/*"))[0]


def _keep_step_3(run_dir: Path) -> None:
    shutil.rmtree(run_dir / "local" / "6")
    shutil.rmtree(run_dir / "checkpoints" / "6")


def _wipe_rank_1(run_dir: Path) -> None:
    for d in (run_dir / "local").glob("*/rank00001"):
        shutil.rmtree(d)  # everything process 1 had on its node, partner copies included


def _flip_own_and_partner(run_dir: Path) -> None:
    flip(own_blob(run_dir), 100)
    flip(partner_blob(run_dir), 100)


def _damage_persistent_6(run_dir: Path) -> None:
    shutil.rmtree(run_dir / "local")
    victim = persistent_victim(run_dir)
    flip(victim, victim.stat().st_size // 2)


# Damaged copies of one saved run, each restored by the same 2-rank launch (dump_each).
DAMAGE = {
    "baseline": lambda d: None,
    "step3": _keep_step_3,
    "rank1_wiped": _wipe_rank_1,
    "local_wiped": lambda d: shutil.rmtree(d / "local"),
    "own_flipped": lambda d: flip(own_blob(d), 100),
    "own_and_partner_flipped": _flip_own_and_partner,
    "persistent_6_damaged": _damage_persistent_6,
}


@dataclass(frozen=True)
class Restored:
    run_dir: Path   # the damaged copy
    out: Path       # its dump (and the restore's events next to it)
    got: dict       # step, sources, detail and every leaf


@pytest.fixture(scope="module")
def restored(tmp_path_factory) -> dict[str, Restored]:
    """A 2 x 4 run with local steps 3, 6 (partner copies on) and persistent steps 3, 6, then
    each DAMAGE applied to its own copy and restored."""
    base = tmp_path_factory.mktemp("saved")
    run_dir = base / "run"
    proc = train(2, run_dir, *CKPT)
    assert proc.returncode == 0, proc.stderr[-6000:]
    pairs = []
    for name, damage in DAMAGE.items():
        shutil.copytree(run_dir, base / name)
        damage(base / name)
        pairs.append((base / name, base / f"{name}.npz"))
    dumps = dump_each(2, pairs, *CKPT)
    out = {name: Restored(d, o, got) for (name, (d, o)), got in zip(zip(DAMAGE, pairs), dumps)}
    assert (out["baseline"].got["step"], out["baseline"].got["sources"]) == (6, ["local"] * 2)
    assert (out["step3"].got["step"], out["step3"].got["sources"]) == (3, ["local"] * 2)
    return out


def fallback_problems(out: Path) -> list[str]:
    events = out.with_name(out.stem + ".events0.jsonl")
    return [p for line in events.read_text().splitlines()
            for p in json.loads(line).get("problems", [])]


def test_one_process_local_tier_wiped_restores_from_the_copy_rank_0_holds(restored):
    """Both ranks' "nodes" share this one disk: rank 1, with no directory of its own, reads
    the partner copy in rank 0's directory from the disk (spmd.checkpoint.local: a renumbered
    rank finds its node's other rank directories). The copy sent over MPI from another node's
    disk is tested below (a flipped own copy) and across real nodes in tests/multinode."""
    got = restored["rank1_wiped"].got
    assert (got["step"], got["sources"]) == (6, ["local", "local"])
    assert not (restored["rank1_wiped"].run_dir / "local" / "6" / "rank00001").exists()
    assert same_state(got, restored["baseline"].got) == []


def test_all_local_tiers_wiped_restores_from_persistent(restored):
    got = restored["local_wiped"].got
    assert (got["step"], got["sources"]) == (6, ["persistent", "persistent"])
    assert same_state(got, restored["baseline"].got) == []


def test_flipped_byte_falls_back_to_partner_then_persistent(restored):
    one = restored["own_flipped"]
    assert (one.got["step"], one.got["sources"]) == (6, ["partner", "local"])
    own = own_blob(one.run_dir)
    assert any(str(own) in p and "crc32" in p for p in fallback_problems(one.out))
    assert same_state(one.got, restored["baseline"].got) == []

    both = restored["own_and_partner_flipped"]
    assert (both.got["step"], both.got["sources"]) == (6, ["persistent", "persistent"])
    problems = fallback_problems(both.out)
    assert any(str(own_blob(both.run_dir)) in p for p in problems)
    assert any(str(partner_blob(both.run_dir)) in p for p in problems)
    assert same_state(both.got, restored["baseline"].got) == []


def test_damaged_persistent_step_falls_back_to_an_older_one(restored):
    r = restored["persistent_6_damaged"]
    assert (r.got["step"], r.got["sources"]) == (3, ["persistent", "persistent"])
    assert any(str(persistent_victim(r.run_dir)) in p for p in fallback_problems(r.out))
    # saved while training went on (donating the state): still the exact step-3 state
    assert same_state(r.got, restored["step3"].got) == []


@pytest.mark.parametrize("saver,reader", [
    ((2, 4, "fsdp_tp"), (1, 8, "dp")),
    ((1, 8, "dp"), (2, 4, "fsdp_tp")),
], ids=["2x4-fsdp_tp-to-1x8-dp", "1x8-dp-to-2x4-fsdp_tp"])
def test_restore_onto_another_mesh_and_process_count(tmp_path, saver, reader):
    (n, devices, strategy), (n2, devices2, strategy2) = saver, reader
    run_dir = tmp_path / "run"
    ck = ("train.steps=4", "checkpoint.every=4", "checkpoint.persistent_every=4",
          "checkpoint.timeout_s=60", "run.plots=false")
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
