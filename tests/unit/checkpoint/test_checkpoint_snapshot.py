"""The blocking part of a save (`checkpoint.snapshot`): reused buffers, donation safety, modes.

One process, 8 CPU devices. On CPU every mode is a real code path: `host` copies into the
reused host buffers, `pinned` transfers into the CPU backend's pinned_host memory space,
`device` makes an on-device copy and fills the host buffers in the background.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from spmd.checkpoint.snapshot import resolve_mode
from spmd.config.load import config_from_dict
from spmd.errors import ConfigError
from spmd.launch import jax_stack
from tests.helpers.stand_ins import RecordedEvents, one_process_checkpointer


def _cfg(run_dir: Path, **ck):
    return config_from_dict({"run": {"dir": str(run_dir)},
                             "checkpoint": {"every": 1, "persistent_every": 2, "keep": 3, **ck}})


def _state(mesh, seed=0):
    rng = np.random.default_rng(seed)

    def put(x, spec):
        return jax.device_put(x, NamedSharding(mesh, spec))

    return {"step": put(jnp.int32(seed), P()),
            "params": {"w": put(rng.standard_normal((64, 32), np.float32), P("data", "tensor")),
                       "b": put(jnp.asarray(rng.standard_normal(32), jnp.bfloat16), P())},
            "rng": put(np.array([seed, 1], np.uint32), P())}


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        tree)


def _host(tree):
    """Bytes of every leaf, taken before anything can touch the device buffers: of an
    on-device copy, since jaxlib 0.11.2 keeps a buffer copied to the host from the next
    step's donation (spmd.launch.jax_stack)."""
    return [np.array(jax.device_put(x, may_alias=False)) for x in jax.tree.leaves(tree)]


def _same_bytes(tree, expected):
    leaves = jax.tree.leaves(tree)
    return len(leaves) == len(expected) and all(
        np.asarray(a).tobytes() == b.tobytes() and np.asarray(a).dtype == b.dtype
        for a, b in zip(leaves, expected))


@jax.jit
def _bump(state):
    return jax.tree.map(lambda x: x * 3 + jnp.ones((), x.dtype), state)


# donates the state it is given, like the trainer's train step
_donating_step = jax.jit(lambda s: jax.tree.map(lambda x: x * 3 + jnp.ones((), x.dtype), s),
                         donate_argnums=0)


@pytest.fixture
def meshes():
    devices = np.array(jax.devices()[:8])
    return (jax.sharding.Mesh(devices.reshape(2, 4), ("data", "tensor")),
            jax.sharding.Mesh(devices.reshape(8, 1), ("data", "tensor")))


@pytest.mark.parametrize("mode", ["alias", "host", "host-through-device", "pinned", "device"])
def test_snapshot_reuses_buffers_and_a_donated_step_cannot_change_saved_bytes(
        tmp_path, meshes, mode, monkeypatch):
    if mode == "host-through-device":   # what host mode does on jaxlib 0.11.2, on any release
        monkeypatch.setattr(jax_stack, "host_copy_blocks_donation", lambda: True)
        mode = "host"
    mesh, other = meshes
    events = RecordedEvents()
    ck = one_process_checkpointer(_cfg(tmp_path, snapshot=mode), events)
    state = _state(mesh, seed=1)
    assert ck.restore(_abstract(state)) is None
    snapper = ck.snapshotter
    # allocated at start-up (when the checkpointer first saw the layout), not in a save
    assert snapper.mode == mode and snapper.buffers is not None
    buffers, allocations = snapper.buffers, snapper.buffers.allocations
    addresses = buffers.addresses()
    if mode in ("host", "device"):   # pinned/alias: the tiers read the arrays/views themselves
        assert allocations > 0 and len(addresses) == allocations
    else:
        assert allocations == 0

    expected = {}
    for step in (1, 2, 3, 4):
        expected[step] = _host(state)
        ck.maybe_save(step, state)
        old = jax.tree.leaves(state)
        state = _donating_step(state)      # right after maybe_save returns
        if mode != "alias":   # alias: the views pin buffers that XLA then will not reuse
            assert all(x.is_deleted() for x in old), "the step did not donate the saved state"
    ck.wait()
    # nothing was allocated by the saves: same buffer objects at the same addresses
    assert snapper.buffers is buffers and buffers.allocations == allocations
    assert buffers.addresses() == addresses
    # one snapshot per step, shared by both tiers when both saved it
    assert ck.summary()["snapshots"] == 4
    saved = events.of("saved")
    assert sorted((r["tier"], r["step"]) for r in saved) == [
        ("local", 1), ("local", 2), ("local", 3), ("local", 4), ("persistent", 2),
        ("persistent", 4)]
    assert all(r["shared"] == (r["step"] % 2 == 0) and r["snapshot"] == mode for r in saved)
    assert all(r["blocking_s"] >= 0 and r["waited_s"] >= 0 and r["ready_s"] >= 0 for r in saved)
    ck.close()
    (summary,) = events.of("checkpoint_summary")
    assert summary["saves"] == {"local": 4, "persistent": 2} and summary["snapshots"] == 4
    assert 0 < summary["blocking_s"] < summary["wall_s"]
    assert 0 < summary["blocked_fraction"] < 1

    # the committed checkpoints hold the pre-step bytes, bit for bit, in both tiers
    events = RecordedEvents()
    ck = one_process_checkpointer(_cfg(tmp_path, snapshot=mode), events)
    r = ck.restore(_abstract(_state(mesh)))
    assert (r.step, r.source) == (4, "local") and _same_bytes(r.state, expected[4])
    (timing,) = events.of("restore_timing")
    assert {"plan_s", "read_s", "exchange_s", "h2d_s", "total_s"} <= set(timing)
    assert timing["read_s"] > 0 and timing["h2d_s"] > 0
    # restored arrays do not alias the reused buffers the next save refills
    ck.maybe_save(5, _bump(r.state))
    ck.wait()
    assert _same_bytes(r.state, expected[4])
    ck.close()
    ck = one_process_checkpointer(_cfg(tmp_path, snapshot=mode), RecordedEvents())
    r = ck.restore(_abstract(jax.tree.map(
        lambda x: jax.device_put(x, NamedSharding(other, P())), _state(mesh))))
    assert (r.step, r.source) == (4, "persistent") and _same_bytes(r.state, expected[4])
    assert r.timings["orbax_s"] > 0
    ck.close()


def test_auto_picks_zero_copy_views_on_cpu_and_explicit_modes_are_kept(meshes):
    leaves = jax.tree.leaves(_abstract(_state(meshes[0])))
    assert resolve_mode("auto", leaves)[0] == "alias"
    for mode in ("alias", "host", "pinned", "device"):
        assert resolve_mode(mode, leaves)[0] == mode
    with pytest.raises(ValueError, match="checkpoint.snapshot"):
        resolve_mode("fast", leaves)


def test_invalid_snapshot_mode_is_a_one_line_config_error(tmp_path):
    with pytest.raises(ConfigError) as e:
        _cfg(tmp_path, snapshot="fast")
    message = str(e.value)
    assert "checkpoint.snapshot" in message and "\n" not in message
    assert "'device'" in message and "'pinned'" in message


def test_alias_views_survive_a_donating_step_that_rewrites_the_state(meshes):
    """The zero-copy views pin the buffers: each donating step leaves every piece's bytes."""
    from spmd.checkpoint.layout import SaveLayout
    from spmd.checkpoint.snapshot import Snapshotter

    state = _state(meshes[0], seed=2)
    snapper = Snapshotter("alias", rank=0, timeout_s=10)
    snapper.prepare(SaveLayout.build(state, 1, True), state, local=True, persistent=True)
    assert snapper.mode == "alias" and snapper.buffers.allocations == 0
    for step in range(3):
        before = _host(state)
        snap, _, blocking = snapper.take(step, state, consumers=1)
        for _ in range(2):                 # two in-place rewrites while the snapshot lives
            state = _donating_step(state)
        jax.block_until_ready(state)
        saved = jax.tree.leaves(snap.arrays())
        assert all(np.asarray(a).tobytes() == b.tobytes() for a, b in zip(saved, before))
        pieces = snap.pieces(snapper.alias_pids)
        assert pieces and all(not p.flags.writeable for p in pieces)
        snap.release()
        assert snapper._live is None and snap.views == {}
