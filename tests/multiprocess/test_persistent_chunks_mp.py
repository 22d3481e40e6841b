"""The persistent tier's chunk checksums with two real processes (issue 40): each rank lists
its own data files by size (never read back), the ranks' chunk crc32c (manifest format /3)
together cover every chunk, retention renames dropped steps away for every rank, and a
flipped byte in rank 1's data file is found by the ranks' split full check, named, and the
restore falls back to the previous step, bit for bit."""

from __future__ import annotations

import json
import shutil

import pytest

from spmd.checkpoint.chunks import item_values
from spmd.checkpoint.persistent import SMALL_FILE, TRASH
from tests.helpers.checkpoint_worker import dump, same_state, train

pytestmark = pytest.mark.slow

# a wider MLP than the tests' default, so that each process's data files exceed SMALL_FILE
CKPT = ("train.steps=9", "checkpoint.every=3", "checkpoint.persistent_every=3",
        "checkpoint.keep=2", "checkpoint.timeout_s=60", "model.d_hidden=512")


def test_two_ranks_checksum_their_chunks_and_a_damaged_step_falls_back(tmp_path):
    run_dir = tmp_path / "run"
    proc = train(2, run_dir, *CKPT)
    assert proc.returncode == 0, proc.stderr[-6000:]
    root = run_dir / "checkpoints"
    # step 3 was dropped (keep=2) by rank 0's rename, and removed before the run ended
    assert sorted(int(p.name) for p in root.iterdir() if p.name.isdigit()) == [6, 9]
    assert not list(root.glob(f"{TRASH}*"))
    manifest = json.loads((root / "9" / "spmd_manifest.json").read_text())
    chunked = {rel for rel, e in manifest["files"].items() if e.get("check") == "chunks"}
    assert any("ocdbt.process_0/" in r for r in chunked), sorted(manifest["files"])
    assert any("ocdbt.process_1/" in r for r in chunked), sorted(manifest["files"])
    assert all(manifest["files"][r]["nbytes"] >= SMALL_FILE for r in chunked)
    # the ranks' crc32c of their chunks (computed while Orbax wrote), together every chunk
    # the items' b-trees hold, and no other
    assert manifest["format"] == "spmd-persistent/3"
    for item in ("params", "train_state"):
        refs, inline = item_values(root / "9" / item)
        keys = {k for vs in refs.values() for _, _, k in vs} | set(inline)
        assert set(manifest["chunks"][item]) == {k for k in keys if "/c" in k}, item

    baseline = tmp_path / "baseline"   # the same run without step 9: restores step 6
    shutil.copytree(run_dir, baseline)
    shutil.rmtree(baseline / "local" / "9")
    shutil.rmtree(baseline / "checkpoints" / "9")
    before = dump(2, baseline, tmp_path / "six.npz", *CKPT)
    assert before["step"] == 6

    victim = max((p for p in (root / "9").rglob("ocdbt.process_1/d/*")),
                 key=lambda p: p.stat().st_size)
    assert victim.relative_to(root / "9").as_posix() in chunked
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    shutil.rmtree(run_dir / "local")
    got = dump(2, run_dir, tmp_path / "d.npz", *CKPT)
    assert (got["step"], got["sources"]) == (6, ["persistent", "persistent"])
    events = (tmp_path / "d.events0.jsonl").read_text().splitlines()
    problems = [p for line in events for p in json.loads(line).get("problems", [])]
    assert any(str(victim) in p and "crc32c" in p for p in problems), problems
    assert same_state(got, before) == []
