"""The crc32c of every chunk Orbax writes, computed from the arrays it is handed while it writes.

Why (issue 40): the persistent tier must vouch for every byte it commits without reading back
what it just wrote. Before, each chunk carried Zarr v3's `crc32c` codec, computed by
TensorStore inside Orbax's write; TensorStore computes it with absl's table-driven software
crc32c (not the SSE4.2 instruction) and copies each chunk to append it: +0.064 s of CPU per
256 MiB, measured, in the write that plain Orbax (no codec) does not pay. Now the chunks are
written plain (Orbax's own Zarr v3 metadata: `bytes` codec, a crc32c on each shard's index
only) and this module computes each chunk's crc32c with google-crc32c (the hardware
instruction, ~6-10 GB/s per core, reading the host buffer in place: no copy where the chunk
is contiguous), on a thread of its own while TensorStore writes. The step's manifest records
them (`"chunks"`: {item: {chunk key: crc32c}}, format `spmd-persistent/3`); spmd's reader
and `spmd ckpt verify` check every chunk against them.

Which chunks: Orbax writes each array as Zarr v3 with one chunk per shard (the grid's chunk
shape is also the inner chunk shape), whose shape is the region one replica writes: a
device's shard, or with replica-parallel writes 1/n of it along the first axis that n
divides, cut smaller where that exceeds the OCDBT target file size (2 GiB). `ChunkSums` asks
Orbax's own functions which regions this process writes (`replica_slices.
get_replica_slices`) and in which chunk shape (`subchunking.choose_chunk_shape`), so each
process sums exactly the chunks it writes and the ranks' maps together name each chunk once.
After the write, `result` compares the chunk shapes with those Orbax recorded
(`<item>/array_metadatas/process_<rank>`, else the array's `zarr.json`) and sums any array
predicted wrong again from the host copies the pass made (never from the files). The pass
holds the arrays it was handed only until it has read them (`wait_pass`): on an accelerator,
the snapshot's device copy is then free to go before the next save takes one (a host copy
of this process's shards is kept until `result`; on CPU a view, no copy).
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from spmd.checkpoint.files import crc32c, hex32
from spmd.checkpoint.interface import CheckpointError

log = logging.getLogger("spmd.checkpoint")


def chunk_key(name: str, cell: Any) -> str:
    """Zarr v3's default chunk key of grid cell `cell` of array `name` ('w/c/0/1'; 'w/c' for
    a scalar): the key under which the item's OCDBT database stores that chunk."""
    return name + "/c" + "".join(f"/{int(i)}" for i in cell)


def _region(index: tuple, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


Piece = tuple[tuple[tuple[int, int], ...], Any, tuple[slice, ...]]   # region, data, cut


def _host(data: Any) -> np.ndarray:
    """A shard's values on the host (zero-copy for CPU arrays and host numpy arrays)."""
    return np.asarray(data)


def written_pieces(leaf: Any) -> tuple[tuple[int, ...], list[Piece]]:
    """(the region shape one replica writes, [(region of the array, the shard's data, the cut
    of that data that is the region)] this process writes), as Orbax decides them
    (`get_replica_slices`); without it, this process's replica-0 shards."""
    if isinstance(leaf, np.ndarray) or np.isscalar(leaf):
        import jax  # Orbax writes host arrays from process 0

        shape = tuple(np.shape(leaf))
        mine = jax.process_index() == 0
        return shape, [(tuple((0, n) for n in shape), leaf, ())] if mine else []
    shape = tuple(leaf.shape)
    try:
        import jax
        import orbax.checkpoint as ocp
        from orbax.checkpoint._src.serialization import replica_slices

        handler = ocp.type_handlers.get_type_handler(jax.Array)
        found = replica_slices.get_replica_slices(
            leaf, getattr(handler, "_replica_id", 0) or 0,
            bool(getattr(handler, "_use_replica_parallel", True)),
            getattr(handler, "_min_slice_bytes_for_replica_parallel", None),
            getattr(handler, "_max_replicas_for_replica_parallel", None))
        pieces = []
        for r in found.replica_slices:
            cut = r.slice_args
            pieces.append((_region(r.index, shape), r.unsliced_data, () if cut is None else tuple(
                slice(cut.start_index, cut.limit_index) if axis == cut.axis else slice(None)
                for axis in range(len(shape)))))
        return tuple(found.local_shape), pieces
    except Exception:   # another Orbax: replica-0 shards; `result` corrects the chunk shape
        return (tuple(leaf.addressable_shards[0].data.shape),
                [(_region(s.index, shape), s.data, ()) for s in leaf.addressable_shards
                 if s.replica_id == 0])


def predicted_chunk_shape(leaf: Any, write_shape: tuple[int, ...],
                          file_bytes: int | None = None) -> tuple[int, ...]:
    """The chunk shape Orbax will choose for `leaf` written in regions of `write_shape`:
    that shape, cut where it exceeds the OCDBT target file size (`file_bytes`, the one the
    save asks for; None: Orbax's default), with Orbax's own functions."""
    try:
        from orbax.checkpoint._src.arrays import subchunking
        from orbax.checkpoint._src.serialization import tensorstore_utils as tu

        dtype = np.dtype(leaf.dtype)
        limit = tu.calculate_chunk_byte_size(write_shape, dtype, chunk_byte_size=None,
                                             ocdbt_target_data_file_size=file_bytes)
        return tuple(subchunking.choose_chunk_shape(tuple(np.shape(leaf)), write_shape, dtype,
                                                    limit))
    except Exception:   # another Orbax: `result` corrects it if wrong
        return write_shape


def leaf_sums(name: str, pieces: list[Piece], chunk_shape: tuple[int, ...]) -> dict[str, str]:
    """{chunk key: crc32c hex} of the chunks of `chunk_shape` inside the regions `pieces`
    (this process's, `written_pieces`) of array `name`."""
    out: dict[str, str] = {}
    for region, data, cut in pieces:
        extent = tuple(b - a for a, b in region)
        if math.prod(extent) == 0:
            continue   # nothing stored
        if len(chunk_shape) != len(extent) or any(
                c <= 0 or n % c or a % c for (a, _), n, c in zip(region, extent, chunk_shape)):
            raise CheckpointError(
                f"{name}: Orbax's chunks {list(chunk_shape)} do not tile the region "
                f"{[list(r) for r in region]} it wrote: its chunk checksums cannot be computed")
        host = _host(data)[cut] if cut else _host(data)
        for cell in np.ndindex(*(n // c for n, c in zip(extent, chunk_shape))):
            part = host[tuple(slice(i * c, (i + 1) * c) for i, c in zip(cell, chunk_shape))]
            key = chunk_key(name, [a // c + i for (a, _), c, i in zip(region, chunk_shape, cell)])
            out[key] = hex32(crc32c(part))
    return out


def recorded_chunk_shapes(item_dir: Path, rank: int, names: set[str]) -> dict[str, tuple]:
    """{array name: chunk shape} as Orbax wrote the item: its `array_metadatas/process_<rank>`
    (kilobytes), and for arrays not listed there the arrays' zarr.json in the b-tree."""
    shapes: dict[str, tuple] = {}
    try:
        listed = json.loads((item_dir / "array_metadatas" / f"process_{rank}").read_bytes())
        for entry in listed.get("array_metadatas", []):
            meta = entry.get("array_metadata", {})
            if meta.get("param_name") in names and meta.get("chunk_shape") is not None:
                shapes[meta["param_name"]] = tuple(meta["chunk_shape"])
    except (OSError, ValueError, AttributeError):
        pass
    if names - set(shapes):
        from spmd.checkpoint.chunks import item_values

        _, inline = item_values(item_dir)
        for name in names - set(shapes):
            raw = inline.get(f"{name}/zarr.json")
            if raw is not None:
                grid = json.loads(raw).get("chunk_grid", {}).get("configuration", {})
                shapes[name] = tuple(grid.get("chunk_shape", ()))
    return shapes


class ChunkSums:
    """The chunk checksums of one save, computed on a thread from `start` (called right
    after Orbax's blocking save returned, while its write runs) until `result`."""

    def __init__(self, items: Mapping[str, Any], file_bytes: int | None = None):
        """`file_bytes`: the OCDBT target data-file size the save asks Orbax for (it also
        caps the chunks' bytes)."""
        import jax

        try:
            from orbax.checkpoint._src.tree.utils import param_name_from_keypath as names_of
        except ImportError as e:
            raise CheckpointError(f"this Orbax names leaves unknown ways ({e}): persistent "
                                  "chunk checksums cannot be computed") from e
        self._leaves: dict[str, list[tuple[str, list[Piece], tuple[int, ...]]]] = {}
        for item, tree in items.items():
            flat, _ = jax.tree_util.tree_flatten_with_path(tree)
            self._leaves[item] = []
            for path, leaf in flat:
                if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(
                        leaf.dtype, jax.dtypes.prng_key):
                    leaf = jax.random.key_data(leaf)   # what Orbax writes of a typed key
                write_shape, pieces = written_pieces(leaf)
                self._leaves[item].append(
                    (names_of(path), pieces,
                     predicted_chunk_shape(leaf, write_shape, file_bytes)))
        self._sums: dict[str, dict[str, dict[str, str]]] = {}
        self._errors: dict[tuple[str, str], Exception] = {}
        self._thread = threading.Thread(target=self._run, name="spmd-ckpt-chunk-crc",
                                        daemon=True)
        self.seconds = 0.0   # the thread's time (the crc32c of every chunk; zero-copy on CPU)

    def start(self) -> ChunkSums:
        self._thread.start()
        return self

    def _run(self) -> None:
        t0 = time.perf_counter()
        for item, leaves in self._leaves.items():
            self._sums[item] = {}
            for i, (name, pieces, shape) in enumerate(leaves):
                try:   # host copies in place of the arrays (zero-copy views on CPU)
                    pieces = [(region, _host(data), cut) for region, data, cut in pieces]
                    leaves[i] = (name, pieces, shape)
                    self._sums[item][name] = leaf_sums(name, pieces, shape)
                except Exception as e:   # raised by `result` unless the shape was wrong
                    self._errors[(item, name)] = e
        self.seconds = time.perf_counter() - t0

    def wait_pass(self) -> None:
        """Until the pass has read every array it was handed: from then on it holds only
        host copies, and the snapshot the arrays came from can be released."""
        if self._thread.ident is not None:
            self._thread.join()

    def result(self, step_dir: Path, rank: int) -> dict[str, dict[str, str]]:
        """{item: {chunk key: crc32c}} of this process's chunks, once Orbax has written the
        step to `step_dir`; arrays whose chunk shape was predicted wrong are summed again."""
        if self._thread.ident is None:
            self._thread.start()
        self._thread.join()
        try:
            out: dict[str, dict[str, str]] = {}
            for item, leaves in self._leaves.items():
                names = {name for name, _, _ in leaves}
                shapes = recorded_chunk_shapes(step_dir / item, rank, names)
                sums = self._sums[item]
                for name, pieces, predicted in leaves:
                    actual = shapes.get(name)
                    if actual is None:
                        raise CheckpointError(f"{step_dir / item}: Orbax recorded no chunk "
                                              f"shape for {name}")
                    if actual != predicted:
                        log.info("persistent save: %s/%s has chunks %s (not %s): summed again "
                                 "after the write", item, name, list(actual), list(predicted))
                        sums[name] = leaf_sums(name, pieces, actual)
                    elif (item, name) in self._errors:
                        raise self._errors[(item, name)]
                out[item] = {k: v for per in sums.values() for k, v in per.items()}
            return out
        finally:
            self._leaves = {}   # the arrays are no longer needed
