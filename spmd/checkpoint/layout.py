"""Which bytes of a sharded train state each process writes, needs and restores.

A *piece* is one distinct shard of one leaf: (leaf, global index). Replicas of a piece live on
several devices and maybe several processes; exactly one process writes it (dedupe). With
`dedupe="global"` the writer is chosen among the processes that hold the piece so that bytes
are balanced over processes (restore then moves pieces between processes over MPI); with
`dedupe="process"` every process writes each distinct piece it holds (no exchange needed).
The layout signature hashes everything that must match for a node-local restore: process
count, which device (and process) holds which index of which leaf, shapes, dtypes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from spmd.sharding import path_str

Key = tuple[tuple[int, int], ...]      # (start, stop) per dimension
PieceId = tuple[int, Key]              # (leaf number, key)


def leaf_paths(tree: Any) -> list[str]:
    """'params/dense/kernel'-style names of the leaves, in flattening order."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [path_str(path) for path, _ in flat]


def index_key(index: tuple[slice, ...], shape: Sequence[int]) -> Key:
    return tuple((s.start or 0, dim if s.stop is None else s.stop) for s, dim in zip(index, shape))


def np_dtype(name: str) -> np.dtype:
    """numpy dtype by name, including ml_dtypes' (bfloat16, float8_*)."""
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))


def key_shape(key: Key) -> tuple[int, ...]:
    return tuple(stop - start for start, stop in key)


def key_text(key: Key) -> str:
    return "[" + ",".join(f"{a}:{b}" for a, b in key) + "]"


@dataclass(frozen=True)
class Piece:
    leaf: int
    key: Key
    dtype: str
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        return key_shape(self.key)


@dataclass
class SaveLayout:
    """Pieces of every leaf, their writer and the processes that need them."""

    paths: list[str]
    shapes: list[tuple[int, ...]]
    dtypes: list[str]
    num_processes: int
    dedupe: str
    writer: dict[PieceId, int] = field(default_factory=dict)
    needers: dict[PieceId, tuple[int, ...]] = field(default_factory=dict)
    signature: str = ""
    description: str = ""

    @classmethod
    def build(cls, tree: Any, num_processes: int, dedupe: str = "global") -> SaveLayout:
        """From a pytree of jax.Arrays or ShapeDtypeStructs carrying shardings."""
        leaves = jax.tree.leaves(tree)
        paths = leaf_paths(tree)
        out = cls(paths, [tuple(x.shape) for x in leaves],
                  [np.dtype(x.dtype).name for x in leaves], num_processes, dedupe)
        load = [0] * num_processes
        digest = hashlib.sha256()
        digest.update(json.dumps([num_processes, dedupe]).encode())
        mesh_desc = None
        placements: dict[Any, tuple[dict[Key, set[int]], str]] = {}
        for i, x in enumerate(leaves):
            sharding = x.sharding
            if mesh_desc is None and hasattr(sharding, "mesh"):
                mesh_desc = {k: int(v) for k, v in sharding.mesh.shape.items() if v > 1}
            try:
                cache_key = (sharding, tuple(x.shape))
                hash(cache_key)
            except TypeError:
                cache_key = None
            if cache_key is None or cache_key not in placements:
                found = _placement(sharding, tuple(x.shape))
                if cache_key is None:
                    holders, placed = found
                else:
                    placements[cache_key] = found
            if cache_key is not None:
                holders, placed = placements[cache_key]
            digest.update(json.dumps([paths[i], list(x.shape), out.dtypes[i]]).encode())
            digest.update(placed.encode())
            itemsize = np.dtype(x.dtype).itemsize
            for key in sorted(holders):
                procs = tuple(sorted(holders[key]))
                nbytes = int(np.prod(key_shape(key), dtype=np.int64)) * itemsize
                out.needers[(i, key)] = procs
                if dedupe == "global":
                    w = min(procs, key=lambda p: (load[p], p))
                    load[w] += nbytes
                    out.writer[(i, key)] = w
                else:
                    out.writer[(i, key)] = -1  # every holder writes its own copy
        out.signature = digest.hexdigest()[:32]
        out.description = (f"{num_processes} process(es), mesh {mesh_desc or '1 device'}, "
                           f"{len(leaves)} arrays")
        return out

    def piece(self, pid: PieceId) -> Piece:
        leaf, key = pid
        itemsize = np_dtype(self.dtypes[leaf]).itemsize
        return Piece(leaf, key, self.dtypes[leaf],
                     int(np.prod(key_shape(key), dtype=np.int64)) * itemsize)

    def writes(self, rank: int) -> list[Piece]:
        """Pieces `rank` writes, in canonical order."""
        return [self.piece(pid) for pid, w in self.writer.items()
                if w == rank or (w == -1 and rank in self.needers[pid])]

    def needs(self, rank: int) -> list[PieceId]:
        """Pieces whose data `rank`'s devices hold, in canonical order."""
        return [pid for pid, procs in self.needers.items() if rank in procs]

    def source_of(self, pid: PieceId, rank: int) -> int:
        """The process whose saved files hold `pid` for a restore on `rank`."""
        w = self.writer[pid]
        return rank if w == -1 else w


def _placement(sharding: Any, shape: tuple[int, ...]) -> tuple[dict[Key, set[int]], str]:
    """Processes holding each distinct index, and a digest of which device holds what."""
    holders: dict[Key, set[int]] = {}
    placement = []
    for device, index in sharding.devices_indices_map(shape).items():
        key = index_key(index, shape)
        holders.setdefault(key, set()).add(device.process_index)
        placement.append((device.id, device.process_index, key))
    return holders, hashlib.sha256(json.dumps(sorted(placement)).encode()).hexdigest()


def as_bytes(arr: np.ndarray) -> memoryview:
    """A flat byte view of a contiguous array (any dtype, scalars included)."""
    return memoryview(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))


def from_bytes(buf: Any, piece: Piece) -> np.ndarray:
    return np.frombuffer(buf, dtype=np_dtype(piece.dtype), count=int(np.prod(piece.shape,
                         dtype=np.int64))).reshape(piece.shape)


def assemble(abstract_leaves: Sequence[Any], data: dict[PieceId, np.ndarray]) -> list[jax.Array]:
    """Global jax.Arrays on the abstract leaves' shardings from host pieces of this process."""
    out = []
    for i, x in enumerate(abstract_leaves):
        shape = tuple(x.shape)
        index_map = x.sharding.addressable_devices_indices_map(shape)
        devices = list(index_map)
        hosts = [data[(i, index_key(index_map[d], shape))] for d in devices]
        # Never alias: `hosts` may be the checkpointer's reused buffers, refilled at every
        # save. The CPU backend wraps suitably aligned numpy memory zero-copy even with
        # may_alias=False (measured with jax 0.10.2), so there each shard gets its own copy;
        # elsewhere device_put is a host-to-device transfer.
        hosts = [np.array(h, copy=True) if d.platform == "cpu" else h
                 for h, d in zip(hosts, devices)]
        singles = jax.device_put(hosts, devices, may_alias=False)
        out.append(jax.make_array_from_single_device_arrays(shape, x.sharding, singles))
    return out
