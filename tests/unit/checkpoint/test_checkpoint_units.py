"""Checkpoint building blocks in one process: layout/dedupe, files, planner, both tiers, CLI."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from spmd.checkpoint import CheckpointError
from spmd.checkpoint.files import ChecksumError, read_json, write_json_atomic
from spmd.checkpoint.layout import SaveLayout
from spmd.checkpoint.listing import scan_local, scan_persistent, verify_local
from spmd.checkpoint.local import partner_map
from spmd.checkpoint.persistent import VerifiedLatestN, file_owner
from spmd.checkpoint.restore_plan import BadSource, CopiesVote, Plan, Planner, SourcesVote
from spmd.config.load import config_from_dict
from spmd.config.schema import Config
from tests.helpers.env import run_spmd
from tests.helpers.stand_ins import RecordedEvents, one_process_checkpointer

# ---------------------------------------------------------------- pure pieces


def test_partner_is_same_position_on_the_next_node():
    assert partner_map([0, 0, 1, 1, 2, 2]) == {0: 2, 1: 3, 2: 4, 3: 5, 4: 0, 5: 1}
    assert partner_map([0, 1]) == {0: 1, 1: 0}
    assert partner_map([0, 0, 0]) == {}               # one node: a partner protects nothing
    holders = partner_map([0, 0, 0, 1])               # uneven nodes still get a copy elsewhere
    assert all(holders[r] != r and [0, 0, 0, 1][holders[r]] != [0, 0, 0, 1][r] for r in holders)


@dataclass(frozen=True)
class FakeDevice:
    id: int
    process_index: int


class FakeSharding:
    """Devices 0..7 on processes 0,0,0,0,1,1,1,1; `split` rows over `split` devices."""

    def __init__(self, split: int):
        self.split = split

    def devices_indices_map(self, shape):
        rows = shape[0] // self.split
        return {FakeDevice(d, d // 4): (slice((d % self.split) * rows,
                                              (d % self.split + 1) * rows), slice(None))
                for d in range(8)}


def _leaf(shape, split):
    return SimpleNamespace(shape=shape, dtype=np.float32, sharding=FakeSharding(split))


def test_replicated_pieces_are_written_once_and_balanced():
    tree = {"a": _leaf((8, 4), 1), "b": _leaf((8, 4), 1), "c": _leaf((8, 4), 8)}
    layout = SaveLayout.build(tree, num_processes=2, dedupe="global")
    w0, w1 = layout.writes(0), layout.writes(1)
    ids0, ids1 = {(p.leaf, p.key) for p in w0}, {(p.leaf, p.key) for p in w1}
    assert not ids0 & ids1                             # nothing written twice
    assert ids0 | ids1 == set(layout.writer)           # everything written once
    # the two replicated arrays go to different processes; c's rows go where they live
    assert {p.leaf for p in w0 if p.leaf < 2} != {p.leaf for p in w1 if p.leaf < 2}
    assert sum(p.nbytes for p in w0) == sum(p.nbytes for p in w1)
    # with per-process dedupe each process writes every distinct piece it holds, once
    per_process = SaveLayout.build(tree, num_processes=2, dedupe="process")
    assert len(per_process.writes(0)) == 2 + 4 and len(per_process.writes(1)) == 2 + 4
    assert per_process.signature != layout.signature
    moved = SaveLayout.build({"a": _leaf((8, 4), 2), "b": tree["b"], "c": tree["c"]}, 2)
    assert moved.signature != layout.signature


def test_atomic_json_and_checksum_mismatch(tmp_path):
    crc = write_json_atomic(tmp_path / "m.json", {"x": 1})
    assert read_json(tmp_path / "m.json", f"{crc:08x}") == {"x": 1}
    (tmp_path / "m.json").write_text('{"x": 2}')
    with pytest.raises(ChecksumError, match="m.json"):
        read_json(tmp_path / "m.json", f"{crc:08x}")
    assert not list(tmp_path.glob(".*tmp*"))


def test_planner_prefers_newest_then_own_then_partner_then_persistent():
    planner = Planner(2)
    first = planner.first([CopiesVote(own=(5, 10), held=((5, 1), (10, 1)), persistent=(5, 10)),
                           CopiesVote(own=(5,), held=((5, 0), (10, 0)))])
    assert first.ok and first.plan == Plan("local", 10, {0: 0, 1: 0})
    d = planner.decide_round([SourcesVote(bad=(BadSource("held", 10, 1, "rank 0: bad partner "
                                                         "copy"),)), SourcesVote()])
    assert not d.ok and d.plan == Plan("persistent", 10)
    assert d.problems == ("rank 0: bad partner copy",)
    assert d.plan.as_event() == {"tier": "persistent", "step": 10}
    d = planner.decide_round([SourcesVote(bad=(BadSource("persistent", 10, -1, "rank 0: bad "
                                                         "file"),)), SourcesVote()])
    assert d.plan == Plan("local", 5, {0: 0, 1: 1})
    assert d.plan.as_event() == {"tier": "local", "step": 5, "servers": {0: 0, 1: 1}}
    assert planner.decide_round([SourcesVote(), SourcesVote()]).ok
    planner.bad |= {("own", 5, 0), ("held", 5, 0), ("persistent", 5, -1)}
    assert planner.plan() == Plan() and Plan().as_event() == {"tier": None}


def test_retention_policy_keeps_newest_verified_and_newer(tmp_path):
    for s in (1, 2, 3):
        (tmp_path / str(s)).mkdir()
        (tmp_path / str(s) / "spmd_manifest.json").write_text("{}")
    (tmp_path / "4").mkdir()  # finalized by Orbax, our manifest not (yet) written
    infos = [SimpleNamespace(step=s) for s in (1, 2, 3, 4)]
    assert VerifiedLatestN(1, tmp_path).should_preserve(infos, context=None) == [
        False, False, True, True]
    (tmp_path / "0").mkdir()
    infos = [SimpleNamespace(step=0)] + infos
    assert VerifiedLatestN(2, tmp_path).should_preserve(infos, context=None) == [
        False, False, True, True, True]


def test_orbax_file_owner():
    assert file_owner("default/ocdbt.process_3/d/abc") == 3
    assert file_owner("default/array_metadatas/process_12") == 12
    assert file_owner("default/manifest.ocdbt") == 0
    assert file_owner("default/d/abc") == 0


# ---------------------------------------------------------------- both tiers, one process


def _cfg(run_dir: Path, **ck) -> Config:
    return config_from_dict({"run": {"dir": str(run_dir)},
                             "checkpoint": {"every": 2, "persistent_every": 4, "keep": 2, **ck}})






def _state(mesh, spec, seed=0):
    rng = np.random.default_rng(seed)
    def put(x, s):
        return jax.device_put(x, NamedSharding(mesh, s))
    return {"step": put(jnp.int32(seed), P()),
            "params": {"w": put(rng.standard_normal((16, 8), np.float32), spec),
                       "b": put(jnp.asarray(rng.standard_normal(8), jnp.bfloat16), P())},
            "rng": put(np.array([seed, 1], np.uint32), P())}


def _abstract(mesh, spec):
    s = _state(mesh, spec)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), s)


def _same(a, b):
    return all(np.asarray(x).tobytes() == np.asarray(y).tobytes() and x.dtype == y.dtype
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.fixture
def meshes():
    devices = np.array(jax.devices()[:8])
    return (jax.sharding.Mesh(devices.reshape(2, 4), ("data", "tensor")),
            jax.sharding.Mesh(devices.reshape(8, 1), ("data", "tensor")))


def test_save_restore_both_tiers_and_fallback(tmp_path, meshes):
    mesh, other = meshes
    cfg, events = _cfg(tmp_path), RecordedEvents()
    ck = one_process_checkpointer(cfg, events)
    assert ck.restore(_abstract(mesh, P("data", "tensor"))) is None
    states = {s: _state(mesh, P("data", "tensor"), seed=s) for s in range(1, 9)}
    for s in range(1, 9):
        ck.maybe_save(s, states[s])
    ck.close()
    saved = sorted((r["tier"], r["step"]) for r in events.records if r["event"] == "saved")
    assert saved == [("local", 2), ("local", 4), ("local", 6), ("local", 8), ("persistent", 4),
                     ("persistent", 8)]
    assert [s.step for s in scan_local(tmp_path / "local")] == [6, 8]   # keep=2
    assert [s.step for s in scan_persistent(tmp_path / "checkpoints")] == [4, 8]

    # same layout: the local tier; another mesh: the persistent tier, resharded
    ck = one_process_checkpointer(cfg, RecordedEvents())
    r = ck.restore(_abstract(mesh, P("data", "tensor")))
    assert (r.step, r.source) == (8, "local") and _same(r.state, states[8])
    ck.close()
    ck = one_process_checkpointer(cfg, RecordedEvents())
    r = ck.restore(_abstract(other, P(None, "data")))
    assert (r.step, r.source) == (8, "persistent") and _same(r.state, states[8])
    assert r.state["params"]["w"].sharding.spec == P(None, "data")
    ck.close()

    # a flipped byte in the local blob: detected, named, and the persistent tier takes over
    blob = tmp_path / "local" / "8" / "rank00000" / "shards.bin"
    data = bytearray(blob.read_bytes())
    data[7] ^= 0x40
    blob.write_bytes(bytes(data))
    assert verify_local(tmp_path / "local")[0][0].startswith(str(blob))
    events = RecordedEvents()
    ck = one_process_checkpointer(cfg, events)
    r = ck.restore(_abstract(mesh, P("data", "tensor")))
    assert (r.step, r.source) == (8, "persistent") and _same(r.state, states[8])
    fallback = [e for e in events.records if e["event"] == "restore_fallback"]
    assert str(blob) in fallback[0]["problems"][0]
    ck.close()


def test_failed_save_surfaces_and_keeps_previous_latest(tmp_path, meshes):
    mesh, _ = meshes
    cfg = _cfg(tmp_path, persistent_every=0, local_failure="stop")
    ck = one_process_checkpointer(cfg, RecordedEvents())
    state = _state(mesh, P("data", "tensor"), seed=2)
    ck.maybe_save(2, state)
    ck.wait()
    (tmp_path / "local" / "4").write_text("in the way")   # a file where the step dir goes
    ck.maybe_save(4, _state(mesh, P("data", "tensor"), seed=4))
    deadline = time.time() + 30
    with pytest.raises(CheckpointError, match=r"rank 0: .*local/4") as err:
        while time.time() < deadline:
            ck.maybe_save(5, state)   # the error surfaces at the next offer
            time.sleep(0.05)
    assert "step 4 was not committed" in str(err.value)
    ck.close()
    (tmp_path / "local" / "4").unlink()
    ck = one_process_checkpointer(cfg, RecordedEvents())
    r = ck.restore(_abstract(mesh, P("data", "tensor")))
    assert r.step == 2 and _same(r.state, state)
    ck.close()


def test_sync_mode_raises_in_maybe_save(tmp_path, meshes):
    mesh, _ = meshes
    cfg = _cfg(tmp_path, persistent_every=0, local_failure="stop", **{"async": False})
    (tmp_path / "local").mkdir(parents=True)
    (tmp_path / "local" / "2").write_text("in the way")
    ck = one_process_checkpointer(cfg, RecordedEvents())
    with pytest.raises(CheckpointError, match="local/2"):
        ck.maybe_save(2, _state(mesh, P("data", "tensor")))
    ck.close()


def test_ckpt_cli_ls_and_verify(tmp_path, meshes):
    mesh, _ = meshes
    run_dir = tmp_path / "run"
    cfg = _cfg(run_dir)
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(cfg.to_yaml())
    ck = one_process_checkpointer(cfg, RecordedEvents())
    for s in (2, 4):
        ck.maybe_save(s, _state(mesh, P("data", "tensor"), seed=s))
    ck.close()
    ls = run_spmd("ckpt", "ls", str(run_dir), "--json")
    assert ls.returncode == 0, ls.stderr
    listing = json.loads(ls.stdout)
    assert listing["latest"] == {"local": 4, "persistent": 4}
    assert [s["committed"] for s in listing["local"]] == [True, True]
    ok = run_spmd("ckpt", "verify", str(run_dir))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    victim = sorted((run_dir / "checkpoints" / "4").rglob("ocdbt.process_0/d/*"))[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 1
    victim.write_bytes(bytes(data))
    bad = run_spmd("ckpt", "verify", str(run_dir))
    assert bad.returncode == 1 and str(victim) in bad.stderr


def test_compressed_and_uncompressed_persistent_steps_restore_either_way(tmp_path, meshes):
    mesh, other = meshes
    state = _state(mesh, P("data", "tensor"), seed=3)
    for save_compressed in (True, False):
        run = tmp_path / f"c{save_compressed}"
        ck = one_process_checkpointer(_cfg(run, every=0, compress=save_compressed),
                                      RecordedEvents())
        ck.maybe_save(4, state)
        ck.close()
        ck = one_process_checkpointer(_cfg(run, every=0, compress=not save_compressed),
                                      RecordedEvents())
        r = ck.restore(_abstract(other, P("data", None)))
        assert (r.step, r.source) == (4, "persistent") and _same(r.state, state)
        ck.close()


def test_failed_persistent_save_surfaces_and_keeps_previous_step(tmp_path, meshes):
    mesh, _ = meshes
    cfg = _cfg(tmp_path, every=0, persistent_every=2)
    ck = one_process_checkpointer(cfg, RecordedEvents())
    state = _state(mesh, P("data", "tensor"), seed=2)
    ck.maybe_save(2, state)
    ck.wait()
    pers = tmp_path / "checkpoints"
    pers.rename(tmp_path / "moved")          # the directory is replaced by a file mid-run
    pers.write_text("not a directory")
    # Orbax creates the step directory synchronously: the error may come right away
    with pytest.raises(CheckpointError, match=r"rank 0: cannot create step 4's directory "
                                              r"in .*checkpoints \(checkpoint.persistent_dir\)"):
        ck.maybe_save(4, state)
        ck.close()
    pers.unlink()
    (tmp_path / "moved").rename(pers)
    ck = one_process_checkpointer(cfg, RecordedEvents())
    r = ck.restore(_abstract(mesh, P("data", "tensor")))
    assert (r.step, r.source) == (2, "persistent") and _same(r.state, state)
    ck.close()
