"""spmd's reader of persistent steps (spmd.checkpoint.reader, issue 40): the arrays it reads
are bit for bit Orbax's, onto the saved mesh and onto another; every chunk it reads is
checked against the crc32c the step's manifest holds (format /3; a flipped byte fails the
read, naming the file, and so does a chunk the manifest has no crc32c for); replicated
shards never share a buffer; steps it does not understand (compressed) are left to Orbax."""

from __future__ import annotations

import collections
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from spmd.checkpoint.chunks import item_values
from spmd.checkpoint.persistent import PersistentTier, read_manifest
from spmd.checkpoint.reader import DamagedChunk, Unsupported, read_item, supports
from spmd.config.load import config_from_dict
from tests.helpers.stand_ins import RecordedEvents, one_process_checkpointer

Adam = collections.namedtuple("Adam", ["count", "mu"])


def _mesh(shape=(2, 4)):
    return jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(shape), ("data", "tensor"))


def _state() -> dict:
    mesh = _mesh()
    rng = np.random.default_rng(7)
    put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))  # noqa: E731
    w = rng.standard_normal((64, 48), np.float32)
    return {"step": put(np.int32(12), P()),
            "weights": {"w": put(w, P("data", "tensor")),
                       "b": put(rng.standard_normal(48).astype(jax.numpy.bfloat16), P()),
                       "k": put(rng.integers(0, 2**31, (8, 6)).astype(np.uint32), P("data"))},
            "opt": (Adam(put(np.int32(3), P()), {"w": put(w * 0.5, P(None, "tensor"))}),)}


def _abstract(state, sharding_of=None):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=x.sharding if sharding_of is None else sharding_of(x)),
        state)


def _same(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        x.dtype == y.dtype and np.asarray(x).tobytes() == np.asarray(y).tobytes()
        for x, y in zip(la, lb))


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("reader")
    state = _state()
    for name, compress in (("run", False), ("zstd", True)):
        cfg = config_from_dict({"run": {"dir": str(root / name)}, "checkpoint": {
            "every": 0, "persistent_every": 1, "keep": 1, "compress": compress}})
        ck = one_process_checkpointer(cfg, RecordedEvents())
        ck.maybe_save(5, state)
        ck.close()
    return root, state


def _item(root: Path, run: str = "run") -> Path:
    return root / run / "checkpoints" / "5" / "train_state"


def _sums(item: Path) -> dict[str, str]:
    """The step manifest's {chunk key: crc32c} of an item (format /3)."""
    return read_manifest(item.parent)["chunks"][item.name]


def _orbax(item: Path, abstract):
    with ocp.PyTreeCheckpointer() as ckptr:
        return ckptr.restore(item, args=ocp.args.PyTreeRestore(
            item=abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract)))


def test_reads_what_orbax_reads_onto_the_saved_and_another_mesh(saved):
    root, state = saved
    item = _item(root)
    got = read_item(item, _abstract(state), sums=_sums(item))
    assert _same(got, state) and _same(got, _orbax(item, _abstract(state)))
    assert all(g.sharding == s.sharding for g, s in zip(jax.tree.leaves(got),
                                                         jax.tree.leaves(state)))
    # another mesh: regions that cut across the stored shards, and whole replicas
    other = _mesh((4, 2))
    # leaves in order: opt count, opt mu w, step, weights b, k, w
    specs = iter([P(), P("data"), P(), P("tensor"), P("data"), P(None, "tensor")])
    target = _abstract(state, lambda x: NamedSharding(other, next(specs)))
    moved = read_item(item, target, sums=_sums(item))
    assert _same(moved, state) and _same(moved, _orbax(item, target))
    # replicas are copies: a donating step on one device cannot change another's
    b = moved["weights"]["b"]
    pointers = {s.data.unsafe_buffer_pointer() for s in b.addressable_shards}
    assert len(pointers) == len(b.addressable_shards) == 8


def test_flipped_byte_fails_the_read_naming_the_file(saved, tmp_path):
    import shutil

    root, state = saved
    item = tmp_path / "train_state"
    shutil.copytree(_item(root), item)
    refs, _ = item_values(item)
    (name, offset, length), = [(n, o, ln) for n, vs in refs.items() for o, ln, key in vs
                                if key == "weights.w/c/1/2"]
    victim = item / name
    data = bytearray(victim.read_bytes())
    data[offset + length // 2] ^= 0x01     # inside the shard's one chunk
    victim.write_bytes(bytes(data))
    sums = _sums(_item(root))
    with pytest.raises(DamagedChunk, match="fails its crc32c") as e:
        read_item(item, _abstract(state), sums=sums)
    assert str(victim) in str(e.value) and "weights.w/c/1/2" in str(e.value)
    # a chunk the manifest holds no crc32c for is never read unchecked
    fewer = {k: v for k, v in sums.items() if k != "weights.k/c/1/0"}
    with pytest.raises(DamagedChunk, match="no crc32c") as e:
        read_item(_item(root), _abstract(state), sums=fewer)
    assert "weights.k/c/1/0" in str(e.value)


def test_leaves_what_it_does_not_understand_to_orbax(saved):
    root, state = saved
    with pytest.raises(Unsupported, match="compressed"):
        read_item(_item(root, "zstd"), _abstract(state))
    # what the ranks agree on before reading (metadata alone)
    sums = _sums(_item(root))
    assert supports(_item(root), _abstract(state), sums=sums)
    assert not supports(_item(root), _abstract(state))   # plain chunks need the manifest's
    assert not supports(_item(root, "zstd"), _abstract(state))
    smaller = {k: v for k, v in state.items() if k != "opt"}
    with pytest.raises(Unsupported, match="other arrays"):
        read_item(_item(root), _abstract(smaller), sums=sums)
    assert _same(read_item(_item(root), _abstract(smaller), partial=True, sums=sums), smaller)
    # the tier reads the compressed step with Orbax, bit for bit
    tier = PersistentTier(root / "zstd" / "checkpoints", 0, 1, 1, 1, 60.0, False, None,
                          compress=True)
    try:
        assert not tier.readable(5, _abstract(state))
        with pytest.raises(Unsupported):   # several processes: never Orbax's read unagreed
            tier.restore(5, _abstract(state), orbax=False)
        restored, missing = tier.restore(5, _abstract(state))
    finally:
        tier.close()
    assert missing == () and _same(restored, state)
