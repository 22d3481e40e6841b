"""The persistent tier's data files (spmd.checkpoint.data_files): a step is split into several
OCDBT data files, written at once, of the size `checkpoint.persistent_file_mb` sets or the
automatic one; a step so split is listed, restored bit for bit and checked like any other."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from spmd.checkpoint.chunks import item_values
from spmd.checkpoint.data_files import (
    MAX_FILE_BYTES,
    MIN_FILE_BYTES,
    share_of_state,
    target_file_bytes,
)
from spmd.checkpoint.persistent import SMALL_FILE, read_manifest, verify_files
from spmd.config.load import config_from_dict
from tests.helpers.stand_ins import RecordedEvents, one_process_checkpointer

MiB = 1 << 20


def test_the_automatic_size_is_an_eighth_of_a_process_share_within_bounds():
    assert target_file_bytes(256 * MiB) == 32 * MiB                     # a share of 256 MiB
    assert target_file_bytes(4 * MiB) == MIN_FILE_BYTES == 16 * MiB    # no swarm of tiny files
    assert target_file_bytes(1 << 40) == MAX_FILE_BYTES == 2048 * MiB  # a large state
    assert target_file_bytes(256 * MiB, configured_mb=5) == 5 * MiB    # the key sets it outright
    assert target_file_bytes(1 << 40, configured_mb=4096) == 4096 * MiB


def _state(rows: int, host: bool = False) -> dict:
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "tensor"))
    rng = np.random.default_rng(rows)
    put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))  # noqa: E731
    return {"step": put(np.int32(7), P()),
            "params": {"w": put(rng.standard_normal((rows, 256), np.float32),
                                P("data", "tensor")),
                       "v": put(rng.standard_normal((rows, 256), np.float32), P("data")),
                       **({"host": rng.standard_normal((rows, 4)).astype(np.float32)}
                          if host else {})}}


def test_a_process_share_counts_each_array_once_whatever_its_replicas():
    """The same on every process (no communication): the arrays' whole sizes over the
    process count (one process here), replicated or sharded, host arrays too."""
    state = _state(64, host=True)
    w, v, host = (state["params"][k] for k in ("w", "v", "host"))
    assert len(v.addressable_shards) == 8 and v.nbytes == 64 * 256 * 4  # 4 replicas of 2 halves
    assert share_of_state(state) == 4 + w.nbytes + v.nbytes + host.nbytes


def _save(run_dir: Path, state: dict, **ck) -> Path:
    cfg = config_from_dict({"run": {"dir": str(run_dir)}, "checkpoint": {
        "every": 0, "persistent_every": 1, "keep": 1, **ck}})
    saver = one_process_checkpointer(cfg, RecordedEvents())
    saver.maybe_save(1, state)
    saver.close()
    return run_dir / "checkpoints" / "1"


def _data_files(step_dir: Path) -> list[Path]:
    return sorted(p for p in step_dir.rglob("ocdbt.process_*/d/*") if p.is_file())


def test_a_step_in_many_data_files_is_listed_restored_bit_for_bit_and_checked(tmp_path):
    state = _state(2048)    # 2 MiB each for w and v
    step_dir = _save(tmp_path / "split", state, persistent_file_mb=1)
    many = [p for p in _data_files(step_dir) if "params" in p.parts]
    # 4 MiB of values in files closed once past 1 MiB (by a few bytes of a b-tree node)
    assert sum(p.stat().st_size for p in many) >= 4 * MiB
    assert max(p.stat().st_size for p in many) <= MiB + 4096, [p.stat().st_size for p in many]
    manifest = read_manifest(step_dir)
    for p in many:   # every data file listed; the large ones by size, their chunks by crc32c
        entry = manifest["files"][p.relative_to(step_dir).as_posix()]
        assert entry["nbytes"] == p.stat().st_size
        assert ("check" in entry) == (p.stat().st_size >= SMALL_FILE), entry
    assert verify_files(step_dir, manifest, 0, 1) == []
    cfg = config_from_dict({"run": {"dir": str(tmp_path / "split")},
                            "checkpoint": {"every": 0, "persistent_every": 1}})
    reader = one_process_checkpointer(cfg, RecordedEvents())
    got = reader.restore(jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state))
    reader.close()
    assert (got.step, got.source) == (1, "persistent")
    for a, b in zip(jax.tree.leaves(got.state), jax.tree.leaves(state)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    refs, _ = item_values(step_dir / "params")   # a chunk the b-tree points at
    name, spans = max(refs.items(), key=lambda kv: len(kv[1]))
    victim, (offset, length, _) = step_dir / "params" / name, spans[-1]
    data = bytearray(victim.read_bytes())
    data[offset + length // 2] ^= 0x10
    victim.write_bytes(bytes(data))
    problems = verify_files(step_dir, manifest, 0, 1)
    assert len(problems) == 1 and str(victim) in problems[0], problems
