"""The blocking part of a save: one frozen copy of the train state per step, shared by both tiers.

`maybe_save` blocks only while `Snapshotter.take` runs; everything else (the host copy of a
device or pinned snapshot, crc32, files, partner exchange, Orbax, agreement, commit) reads the
`Snapshot` in the background. Modes (`checkpoint.snapshot`):

* ``alias``  - CPU only: zero-copy read-only NumPy views of this process's shards (what
  Orbax's async save does there). A view is an external reference to the buffer, so a
  donating train step right after cannot reuse it: XLA gives that step fresh output buffers
  and the old ones live until the snapshot is released. No copy blocks the step; the price
  is one extra state-sized allocation in the next step. What ``auto`` picks on CPU.
* ``host``   - device-to-host copy of this process's pieces straight into host buffers that
  were allocated (and their pages touched) once, when the checkpointer first saw the state
  layout. On CPU this is one memcpy per piece. On jaxlib 0.11.2, which keeps a buffer copied
  to the host from donation, each piece is copied on the device first and the copy goes to
  the host (`spmd.launch.jax_stack.host_copy_blocks_donation`).
* ``pinned`` - `jax.device_put` of the whole state into ``pinned_host`` memory (the transfer
  Orbax itself uses); XLA keeps freed pinned memory in its host allocator pool, which is
  filled once at start-up (`prepare`) so that no save pays the slow pinned allocation.
* ``device`` - an on-device copy (`device_put(..., may_alias=False)`); the device-to-host copy
  into the reused host buffers happens in the background. Needs free device memory for one
  copy of this process's shards.
* ``auto``   - CPU: ``alias``; otherwise ``device`` when `memory_stats()` shows room for one
  more copy (with 25% headroom), else ``pinned`` where the backend has pinned host memory,
  else ``host``.

Invariants: a `Snapshot` never shares a buffer that the live state can overwrite (a
donating train step right after `take` cannot change it; ``alias`` shares buffers that its
views pin, which donation then cannot reuse); at most one `Snapshot` is alive at a time, and
`take` waits (counted as ``waited_s``) until every consumer of the previous one released it; the
host buffers are allocated once per layout and never reallocated (`allocations` counts them).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from spmd.checkpoint.files import parallel_map
from spmd.checkpoint.layout import (
    PieceId,
    SaveLayout,
    index_key,
    key_shape,
    np_dtype,
)
from spmd.launch import jax_stack

log = logging.getLogger("spmd.checkpoint")

MODES = ("auto", "alias", "host", "pinned", "device")
HEADROOM = 1.25      # device mode needs this many times the snapshot's bytes free per device


def has_pinned_host(device: Any) -> bool:
    try:
        return any(m.kind == "pinned_host" for m in device.addressable_memories())
    except Exception:  # older or exotic backends: no memory kinds
        return False


def free_device_bytes(device: Any) -> int | None:
    """bytes_limit - bytes_in_use of `device`, or None where the backend does not say."""
    try:
        stats = device.memory_stats()
    except Exception:
        return None
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))


def device_bytes(leaves: Sequence[Any]) -> dict[Any, int]:
    """Bytes of the state's shards on each addressable device."""
    out: dict[Any, int] = {}
    for x in leaves:
        itemsize = np.dtype(x.dtype).itemsize
        for d, index in x.sharding.addressable_devices_indices_map(tuple(x.shape)).items():
            n = int(np.prod(key_shape(index_key(index, tuple(x.shape))), dtype=np.int64))
            out[d] = out.get(d, 0) + n * itemsize
    return out


def resolve_mode(requested: str, leaves: Sequence[Any]) -> tuple[str, str]:
    """(mode, why) for `requested` on the devices holding `leaves` (abstract or concrete)."""
    if requested not in MODES:
        raise ValueError(f"checkpoint.snapshot must be one of {', '.join(MODES)}, "
                         f"got {requested!r}")
    per_device = device_bytes(leaves)
    devices = list(per_device)
    if not devices:
        return "host", "no addressable shards"
    platform = devices[0].platform
    pinned_ok = all(has_pinned_host(d) for d in devices)
    if requested == "pinned" and not pinned_ok:
        return "host", f"the {platform} backend has no pinned_host memory"
    if requested == "alias" and platform != "cpu":
        return "host", f"alias needs the CPU backend (zero-copy host views), not {platform}"
    if requested != "auto":
        return requested, "checkpoint.snapshot"
    if platform == "cpu":
        return "alias", "CPU: zero-copy views of the state, as Orbax's async save"
    free = {d: free_device_bytes(d) for d in devices}
    if all(f is not None and f >= HEADROOM * per_device[d] for d, f in free.items()):
        low = min(free[d] - per_device[d] for d in devices)  # type: ignore[operator]
        return "device", f"free device memory allows a copy ({low / 2**30:.1f} GiB left)"
    if pinned_ok:
        why = ("memory_stats() unavailable" if any(f is None for f in free.values())
               else "not enough free device memory for an on-device copy")
        return "pinned", why
    return "host", "no room on the device and no pinned_host memory"


def _chosen_shard(arr: jax.Array, key: Any) -> Any:
    best = None
    for shard in arr.addressable_shards:
        if index_key(shard.index, arr.shape) == key and (
                best is None or shard.device.id < best.device.id):
            best = shard
    if best is None:
        raise RuntimeError(f"no addressable shard with index {key}")
    return best.data


def _pick(store: dict[PieceId, np.ndarray], pids: Sequence[PieceId], rank: int,
          what: str) -> list[np.ndarray]:
    """The arrays of `pids` from `store`; a RuntimeError naming the first one missing."""
    missing = [pid for pid in pids if pid not in store]
    if missing:
        raise RuntimeError(f"rank {rank}: no snapshot {what} for {len(missing)} piece(s), "
                           f"e.g. leaf {missing[0][0]} index {missing[0][1]}")
    return [store[pid] for pid in pids]


class HostBuffers:
    """One contiguous host array per piece, allocated once and pre-faulted (pages touched)."""

    def __init__(self, layout: SaveLayout, pids: Sequence[PieceId]):
        self.pids = list(pids)
        self.arrays: dict[PieceId, np.ndarray] = {}
        self.allocations = 0
        for pid in self.pids:
            p = layout.piece(pid)
            a = np.empty(p.shape, np_dtype(p.dtype))
            a.reshape(-1).view(np.uint8)[::4096] = 0  # touch every page now, not in a save
            self.arrays[pid] = a
            self.allocations += 1
        self.nbytes = sum(a.nbytes for a in self.arrays.values())

    def addresses(self) -> dict[PieceId, int]:
        return {pid: a.ctypes.data for pid, a in self.arrays.items()}


class Snapshot:
    """One step's frozen state. Consumers call `release` once each; then it can be reused."""

    def __init__(self, step: int, mode: str, owner: Snapshotter, tree: Any, consumers: int):
        self.step, self.mode, self.owner, self.tree = step, mode, owner, tree
        self._left = consumers
        self._lock = threading.Lock()
        self._host_ready = mode == "host"
        self.views: dict[PieceId, np.ndarray] = {}   # alias mode: read-only shard views

    def pieces(self, pids: Sequence[PieceId]) -> list[np.ndarray]:
        """Host arrays of `pids` (this process's pieces), filling the reused buffers if needed.

        Background only for ``device`` mode (a device-to-host copy); ``pinned`` returns views
        of the pinned arrays (no copy where JAX exposes them zero-copy); ``host`` the buffers.
        """
        if self.mode == "pinned":
            leaves = jax.tree.leaves(self.tree)
            return [np.asarray(_chosen_shard(leaves[leaf], key)) for leaf, key in pids]
        if self.mode == "alias":
            return _pick(self.views, pids, self.owner.rank, "view")
        with self._lock:
            if not self._host_ready:
                self.owner.fill(jax.tree.leaves(self.tree), self.owner.local_pids,
                                live=False)
                self._host_ready = True
        return self.owner.buffers_for(pids)

    def arrays(self) -> Any:
        """The state as global jax.Arrays for Orbax (their own copy in ``host`` mode)."""
        if self.mode not in ("host", "alias"):
            return self.tree
        layout = self.owner.layout
        assert layout is not None
        bufs = self.views if self.mode == "alias" else self.owner.buffers.arrays
        out = []
        for i, x in enumerate(self.owner.abstract_leaves):
            shape = tuple(x.shape)
            index_map = x.sharding.addressable_devices_indices_map(shape)
            devices = list(index_map)
            hosts = [bufs[(i, index_key(index_map[d], shape))] for d in devices]
            # host: own copies (the CPU backend may wrap numpy memory zero-copy), since the
            # buffers are refilled by the next save while Orbax may still be writing these
            # arrays; alias: the views are read-only and pin their buffers, so no copy
            if self.mode == "host":
                hosts = [np.array(h, copy=True) for h in hosts]
            singles = [jax.device_put(h, d) for h, d in zip(hosts, devices)]
            out.append(jax.make_array_from_single_device_arrays(shape, x.sharding, singles))
        jax.block_until_ready(out)
        return jax.tree.unflatten(self.owner.treedef, out)

    def release(self) -> None:
        with self._lock:
            self._left -= 1
            done = self._left <= 0
        if done:
            self._finish()

    def _finish(self) -> None:
        self.tree = None  # device copies / pinned arrays go back to XLA's pools
        self.views = {}   # alias: the old state buffers are freed with their last view
        self.owner._released(self)


class Snapshotter:
    """Owns the reused host buffers and takes one `Snapshot` per saved step."""

    def __init__(self, requested: str, rank: int, timeout_s: float):
        self.requested, self.rank, self.timeout_s = requested, rank, timeout_s
        self.mode = ""
        self.why = ""
        self.layout: SaveLayout | None = None
        self.buffers: HostBuffers | None = None
        self.abstract_leaves: list[Any] = []
        self.treedef: Any = None
        self.prepare_s = 0.0
        self.local_pids: list[PieceId] = []
        self.alias_pids: list[PieceId] = []
        self._live: Snapshot | None = None
        self._free = threading.Condition()

    def prepare(self, layout: SaveLayout, tree: Any, local: bool, persistent: bool) -> None:
        """Allocate everything a save needs (once per layout): host buffers, pinned pool."""
        if self.layout is not None:
            return
        t0 = time.perf_counter()
        leaves = jax.tree.leaves(tree)
        self.layout, self.treedef = layout, jax.tree.structure(tree)
        self.abstract_leaves = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                                for x in leaves]
        self.mode, self.why = resolve_mode(self.requested, leaves)
        # host mode: the persistent tier builds its arrays from every distinct local index;
        # the other modes fill only the pieces the local tier writes.
        pids = (layout.needs(self.rank) if self.mode in ("host", "alias") and persistent
                else [(p.leaf, p.key) for p in layout.writes(self.rank)] if local else [])
        self.alias_pids = pids if self.mode == "alias" else []
        if self.mode in ("pinned", "alias"):
            pids = []  # the tiers read the pinned arrays or the views themselves
        self.local_pids = [(p.leaf, p.key) for p in layout.writes(self.rank)] if local else []
        self.buffers = HostBuffers(layout, pids)
        if self.mode == "pinned":
            self._warm_pinned()
        self.prepare_s = time.perf_counter() - t0
        log.info("checkpoint snapshot: %s (%s); %d host buffers, %.1f MiB, prepared in %.2f s",
                 self.mode, self.why, len(pids), self.buffers.nbytes / 2**20, self.prepare_s)
        for why in jax_stack.known_bad():
            log.warning("checkpoint snapshot (%s): %s", self.mode, why)

    def _warm_pinned(self) -> None:
        """Fill XLA's pinned-host pool once with a state-sized allocation, then free it."""
        warm = []
        for x in self.abstract_leaves:
            sharding = x.sharding.with_memory_kind("pinned_host")
            warm.append(jax.make_array_from_callback(
                tuple(x.shape), sharding,
                lambda index, x=x: np.zeros(
                    [b - a for a, b in index_key(index, tuple(x.shape))], x.dtype)))
        jax.block_until_ready(warm)
        del warm

    def buffers_for(self, pids: Sequence[PieceId]) -> list[np.ndarray]:
        assert self.buffers is not None
        return _pick(self.buffers.arrays, pids, self.rank, "buffer")

    def fill(self, leaves: Sequence[jax.Array], pids: Sequence[PieceId],
             live: bool = True) -> None:
        """Device-to-host copies of pieces `pids` into their buffers (all started first).
        `live`: the leaves are the train state itself, which the next step donates (not a
        snapshot's own device copy)."""
        dests = self.buffers_for(pids)
        sources = [_chosen_shard(leaves[leaf], key) for leaf, key in pids]
        # jaxlib 0.11.2 keeps a buffer that was copied to the host from the next step's
        # donation: copy a fresh on-device copy of each piece instead (one piece per thread
        # at a time of extra device memory), never the live buffer
        via_device = live and jax_stack.host_copy_blocks_donation()
        if not via_device:
            for s in sources:
                s.copy_to_host_async()

        def copy(item: tuple[Any, np.ndarray]) -> None:
            src, dst = item
            if via_device:
                src = jax.device_put(src, may_alias=False)
            np.copyto(dst, np.asarray(src).reshape(dst.shape), casting="no")

        parallel_map(copy, list(zip(sources, dests)))

    def take(self, step: int, state: Any, consumers: int) -> tuple[Snapshot, float, float]:
        """Freeze `state` for `consumers` tiers: (snapshot, waited_s, blocking_s).

        Waits first (bounded by checkpoint.timeout_s) until the previous snapshot is released.
        """
        t0 = time.perf_counter()
        with self._free:
            if not self._free.wait_for(lambda: self._live is None, self.timeout_s):
                held = self._live.step if self._live else "?"
                raise TimeoutError(
                    f"rank {self.rank}: the snapshot of step {held} was not released within "
                    f"{self.timeout_s:.0f} s (checkpoint.timeout_s)")
        t1 = time.perf_counter()
        leaves = jax.tree.leaves(state)
        views: dict[PieceId, np.ndarray] = {}
        if self.mode == "alias":
            assert self.layout is not None
            for leaf, key in self.alias_pids:
                view = np.asarray(_chosen_shard(leaves[leaf], key))
                views[(leaf, key)] = view.reshape(self.layout.piece((leaf, key)).shape)
            tree = None
        elif self.mode == "host":
            assert self.buffers is not None
            self.fill(leaves, self.buffers.pids)
            tree = None
        elif self.mode == "pinned":
            out = jax.device_put(leaves, [x.sharding.with_memory_kind("pinned_host")
                                          for x in leaves])
            jax.block_until_ready(out)
            tree = jax.tree.unflatten(jax.tree.structure(state), out)
        else:
            out = jax.device_put(leaves, [x.sharding for x in leaves], may_alias=False)
            jax.block_until_ready(out)
            tree = jax.tree.unflatten(jax.tree.structure(state), out)
        blocking = time.perf_counter() - t1
        snap = Snapshot(step, self.mode, self, tree, consumers)
        snap.views = views
        with self._free:
            self._live = snap
        if consumers == 0:
            snap._finish()
        return snap, t1 - t0, blocking

    def _released(self, snap: Snapshot) -> None:
        with self._free:
            if self._live is snap:
                self._live = None
            self._free.notify_all()
