"""Reading a persistent step's arrays straight from its files, each chunk's crc32c checked.

Why (issue 40): TensorStore's Zarr v3 `crc32c` codec checks every chunk on read, but with a
table-driven (software) crc32c and a copy of each chunk to strip the checksum; on a busy CPU
that made spmd's restore ~0.6x Orbax's restore of an unchecked Zarr v2 step. This reader
takes the chunks' places from the item's OCDBT b-tree (`chunks.item_values`), reads each
chunk that a local device needs with one `preadv` into the buffer that becomes the array
(no extra copy when a device's shard is one chunk, the layout Orbax writes), and checks its
crc32c with the hardware crc32c (google-crc32c, ~10 GB/s) from a pool of threads: the
crc32c the chunk carries (format /2: TensorStore's codec), or since format /3 (chunks
written plain) the one the step's manifest records (`spmd.checkpoint.chunk_sums`). Same
guarantee as before: no byte reaches the state unchecked, and a damaged chunk fails the read
(`DamagedChunk`, naming file, key and offset) so that the restore falls back.

It reads only what it fully understands: a step whose every target leaf is a Zarr v3 array
written by spmd's persistent tier (`sharding_indexed`, chunks `bytes` + `crc32c`, or `bytes`
with the manifest's crc32c of each, index at the end with its crc32c, no compression), whose
shape and dtype equal the target's, onto a target with shardings, whose set of arrays is the
target's (or a superset, `partial`).
Anything else (steps of older formats, compressed steps, another model) raises `Unsupported`
and Orbax reads the step as before (and raises its own error where the step does not fit).
Any mesh works: a device's region is cut from the chunks it overlaps.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from spmd.checkpoint.chunks import MISSING, RESIDUE, chunk_problem, item_values
from spmd.checkpoint.files import crc32c
from spmd.checkpoint.interface import CheckpointError

Region = tuple[tuple[int, int], ...]   # (start, stop) per dimension
_THREADS = 8   # mostly waiting for reads (several in flight help a disk or a parallel FS)


class Unsupported(Exception):
    """The step or the target is not one this reader handles: Orbax reads it."""


class DamagedChunk(CheckpointError):
    """A chunk (or shard index) failed its crc32c or lies outside its file."""


def aligned_empty(nbytes: int, align: int = 64) -> np.ndarray:
    """An uninitialized uint8 buffer starting at an `align`-byte boundary: the CPU backend
    wraps such host memory zero-copy (`device_put`), where a 16-byte aligned one is copied."""
    raw = np.empty(nbytes + align, np.uint8)
    skip = -raw.ctypes.data % align
    return raw[skip:skip + nbytes]


def _crc_ok(buf: np.ndarray) -> bool:
    """A buffer that ends in its own little-endian crc32c (hardware crc32c, no copy)."""
    return crc32c(buf) == RESIDUE


class _Source:
    """Where an item's values lie: data files (opened once, read with preadv from any
    thread) and the values inlined in the b-tree."""

    def __init__(self, item_dir: Path):
        self.item_dir = item_dir
        try:
            refs, self.inline = item_values(item_dir)
        except Exception as e:
            raise CheckpointError(f"{item_dir / 'manifest.ocdbt'}: its OCDBT database cannot "
                                  f"be read ({type(e).__name__}: {str(e)[:300]})") from e
        self.values: dict[str, tuple[str, int, int]] = {}
        for name, entries in refs.items():
            for offset, length, key in entries:
                self.values[key] = (name, offset, length)
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def keys(self) -> set[str]:
        return set(self.values) | set(self.inline)

    def has(self, key: str) -> bool:
        return key in self.values or key in self.inline

    def _fd(self, name: str) -> int:
        with self._lock:
            if name not in self._fds:
                self._fds[name] = os.open(self.item_dir / name, os.O_RDONLY)
            return self._fds[name]

    def read(self, key: str, start: int, nbytes: int, into: np.ndarray | None = None
             ) -> np.ndarray:
        """`nbytes` at `start` of value `key`, into `into` (uint8, nbytes long) or a new
        buffer; a short value or file is `DamagedChunk`."""
        buf = aligned_empty(nbytes) if into is None else into
        if key in self.inline:
            raw = self.inline[key]
            if start + nbytes > len(raw):
                raise DamagedChunk(f"{self.item_dir}: inline value {key} holds {len(raw)} "
                                   f"bytes, {start}+{nbytes} wanted")
            buf[:] = np.frombuffer(raw, np.uint8, nbytes, start)
            return buf
        name, offset, length = self.values[key]
        if start + nbytes > length:
            raise DamagedChunk(f"{self.item_dir / name}: {key} at {offset}+{length}: "
                               f"{start}+{nbytes} lies outside the value")
        got = os.preadv(self._fd(name), [memoryview(buf)], offset + start)
        if got != nbytes:
            raise DamagedChunk(f"{self.item_dir / name}: {key} at {offset}+{length}: the file "
                               f"ends {nbytes - got} bytes early")
        return buf

    def length(self, key: str) -> int:
        return len(self.inline[key]) if key in self.inline else self.values[key][2]

    def position(self, key: str) -> tuple[str, int]:
        """(data file, offset) of a value, to read in file order ("" first: inline, absent)."""
        name, offset, _ = self.values.get(key, ("", 0, 0))
        return name, offset

    def where(self, key: str) -> str:
        if key in self.inline:
            return f"{self.item_dir / 'manifest.ocdbt'} (inline value {key})"
        name, offset, length = self.values[key]
        return f"{self.item_dir / name}: {key} at {offset}+{length}"

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


class _Array:
    """One stored array's layout, from its zarr.json, checked against the target leaf."""

    def __init__(self, name: str, meta: dict, leaf: Any, sums: dict[str, str] | None = None):
        if (meta.get("zarr_format") != 3 or meta.get("node_type") != "array"
                or meta.get("storage_transformers")):
            raise Unsupported(f"{name}: not a plain Zarr v3 array")
        self.name, self.shape = name, tuple(meta.get("shape", ()))
        try:
            self.dtype = np.dtype(leaf.dtype)
        except TypeError as e:   # a typed PRNG key: Orbax rebuilds it from its key data
            raise Unsupported(f"{name}: the target's dtype {leaf.dtype}") from e
        if self.shape != tuple(leaf.shape) or meta.get("data_type") != self.dtype.name:
            raise Unsupported(f"{name}: stored {meta.get('data_type')}{list(self.shape)}, "
                              f"target {self.dtype.name}{list(leaf.shape)}")
        encoding = meta.get("chunk_key_encoding", {})
        if encoding.get("name") != "default" or (encoding.get("configuration") or {}).get(
                "separator", "/") != "/":
            raise Unsupported(f"{name}: chunk key encoding {encoding}")
        grid = meta.get("chunk_grid", {})
        codecs = meta.get("codecs", [])
        if grid.get("name") != "regular" or len(codecs) != 1 \
                or codecs[0].get("name") != "sharding_indexed":
            raise Unsupported(f"{name}: not one sharding_indexed codec on a regular grid")
        config = codecs[0].get("configuration", {})
        little = sys.byteorder == "little" or self.dtype.itemsize == 1
        chunk_codecs = [c.get("name") for c in config.get("codecs", [])]
        # each chunk checked by its own crc32c (formats /2) or by the manifest's (/3)
        self.sums = sums if chunk_codecs == ["bytes"] else None
        if (config.get("index_location", "end") != "end" or not little
                or chunk_codecs not in (["bytes", "crc32c"], ["bytes"])
                or (chunk_codecs == ["bytes"] and sums is None)
                or [c.get("name") for c in config.get("index_codecs", [])]
                != ["bytes", "crc32c"]
                or any((c.get("configuration") or {}).get("endian", "little") != "little"
                       for c in config["codecs"][:1] + config["index_codecs"][:1])):
            raise Unsupported(f"{name}: codecs other than bytes + crc32c (compressed?)")
        self.outer = tuple(grid.get("configuration", {}).get("chunk_shape", ()))
        self.inner = tuple(config.get("chunk_shape", ()))
        if len(self.outer) != len(self.shape) or len(self.inner) != len(self.shape) or any(
                i <= 0 or o % i for o, i in zip(self.outer, self.inner)):
            raise Unsupported(f"{name}: chunk shapes {self.outer} / {self.inner}")
        self.per_shard = tuple(o // i for o, i in zip(self.outer, self.inner))
        self.chunks = math.prod(self.per_shard)
        self.chunk_bytes = math.prod(self.inner) * self.dtype.itemsize
        self.stored_bytes = self.chunk_bytes + (4 if self.sums is None else 0)
        if self.sums is not None and self.chunks != 1:
            raise Unsupported(f"{name}: {self.chunks} chunks per shard without their crc32c")
        self.fill = _fill(meta.get("fill_value", 0), self.dtype, name)

    def check(self, src: _Source, key: str, j: int, buf: np.ndarray | None) -> None:
        """Raise `DamagedChunk` unless chunk `j` of shard `key` (`buf`: its stored bytes;
        None: the index marks it absent) is what was written."""
        want = None if self.sums is None else self.sums.get(key)
        if self.sums is not None and want is None:
            raise DamagedChunk(f"{src.where(key)}: the step's manifest has no crc32c for it")
        problem = chunk_problem(j, buf, want)
        if problem is not None:
            raise DamagedChunk(f"{src.where(key)}: {problem}")


def _fill(value: Any, dtype: np.dtype, name: str) -> Any:
    special = {"NaN": np.nan, "Infinity": np.inf, "-Infinity": -np.inf}
    if isinstance(value, str) and value not in special:
        raise Unsupported(f"{name}: fill value {value!r}")
    try:
        return np.array(special.get(value, value) if isinstance(value, str) else value,
                        dtype=dtype)
    except (TypeError, ValueError) as e:
        raise Unsupported(f"{name}: fill value {value!r}") from e


def _chunk_key(name: str, cell: Sequence[int]) -> str:
    return name + "/c" + "".join(f"/{i}" for i in cell) if cell else name + "/c"


def _read_region(src: _Source, arr: _Array, region: Region) -> np.ndarray:
    """The values of `region` of `arr`, every chunk read checked; absent ones: fill value."""
    shape = tuple(b - a for a, b in region)
    cells = [range(a // o, -(-b // o)) if b > a else range(0)
             for (a, b), o in zip(region, arr.outer)]
    one_chunk = (arr.chunks == 1 and all(len(c) == 1 for c in cells)
                 and all(a == c[0] * o and b == a + o for (a, b), c, o in
                         zip(region, cells, arr.outer)))
    out: np.ndarray | None = None
    index_size = 16 * arr.chunks + 4
    for cell in np.ndindex(*[len(c) for c in cells]) if cells else [()]:
        origin = tuple(c[i] for c, i in zip(cells, cell))
        key = _chunk_key(arr.name, origin)
        if not src.has(key):
            if arr.sums is not None and key in arr.sums:
                raise DamagedChunk(f"{src.item_dir / 'manifest.ocdbt'}: {key} is missing from "
                                   "the item's b-tree (the step's manifest has its crc32c)")
            continue
        length = src.length(key)
        if length < index_size:
            raise DamagedChunk(f"{src.where(key)}: too short for a shard index of "
                               f"{arr.chunks} chunk(s)")
        lo_hi = []   # the inner chunks of this shard that overlap the region
        for j, inner in enumerate(np.ndindex(*arr.per_shard) if arr.per_shard else [()]):
            lo = [o * s + i * n for o, s, i, n in zip(origin, arr.outer, inner, arr.inner)]
            hi = [lo_ + n for lo_, n in zip(lo, arr.inner)]
            if not any(h <= a or lo_ >= b for lo_, h, (a, b) in zip(lo, hi, region)):
                lo_hi.append((j, lo, hi))
        # the whole shard wanted: one sequential read of it, index included
        whole = src.read(key, 0, length) if len(lo_hi) == arr.chunks else None
        index = (whole[length - index_size:] if whole is not None
                 else src.read(key, length - index_size, index_size))
        if not _crc_ok(index):
            raise DamagedChunk(f"{src.where(key)}: its shard index fails its crc32c")
        entries = np.frombuffer(index[:-4].tobytes(), "<u8").reshape(arr.chunks, 2)
        for j, lo, hi in lo_hi:
            start, nbytes = (int(v) for v in entries[j])
            if start == MISSING and nbytes == MISSING:
                arr.check(src, key, j, None)
                continue
            if nbytes != arr.stored_bytes or start + nbytes > length - index_size:
                raise DamagedChunk(f"{src.where(key)}: chunk {j} ({start}+{nbytes}) does not "
                                   f"fit the shard or its {arr.stored_bytes} bytes")
            buf = (whole[start:start + nbytes] if whole is not None
                   else src.read(key, start, nbytes))
            arr.check(src, key, j, buf)
            values = buf[:arr.chunk_bytes].view(arr.dtype).reshape(arr.inner)
            if one_chunk:
                return values   # the shard is the region: the read buffer is the array
            if out is None:
                out = _filled(shape, arr)
            dst = tuple(slice(max(a, lo_) - a, min(b, h) - a)
                        for (a, b), lo_, h in zip(region, lo, hi))
            part = tuple(slice(max(a, lo_) - lo_, min(b, h) - lo_)
                         for (a, b), lo_, h in zip(region, lo, hi))
            out[dst] = values[part]
    return _filled(shape, arr) if out is None else out


def _filled(shape: tuple[int, ...], arr: _Array) -> np.ndarray:
    out = aligned_empty(math.prod(shape) * arr.dtype.itemsize).view(arr.dtype).reshape(shape)
    out[...] = arr.fill
    return out


def _region(index: tuple, shape: tuple[int, ...]) -> Region:
    out = []
    for s, n in zip(index, shape):
        start, stop, step = s.indices(n)
        if step != 1:
            raise Unsupported(f"a device index with stride {step}")
        out.append((start, stop))
    return tuple(out)


def supports(item_dir: Path, target: Any, partial: bool = False,
             sums: dict[str, str] | None = None) -> bool:
    """Whether `read_item` reads this item onto `target` (its metadata alone is read): the
    ranks agree on it before reading, so that none is left in Orbax's barriers."""
    try:
        read_item(item_dir, target, partial, dry_run=True, sums=sums)
    except Exception:   # Unsupported, or metadata that cannot be read: Orbax's path
        return False
    return True


def read_item(item_dir: Path, target: Any, partial: bool = False,
              names_of: Any = None, dry_run: bool = False,
              sums: dict[str, str] | None = None) -> Any:
    """The arrays of one Orbax item (a directory of a persistent step) onto `target`'s
    leaves (`jax.ShapeDtypeStruct`s with shardings), as `target`'s tree.

    `partial`: the item may hold arrays the target does not name (not read). Raises
    `Unsupported` (read it with Orbax instead) or `DamagedChunk`/`CheckpointError` (naming
    the file) when a chunk, an index or the b-tree is damaged. `dry_run`: check the
    metadata, read no data, return None. `sums`: the step manifest's {chunk key: crc32c}
    of this item (format /3), against which chunks without a crc32c of their own are checked.
    """
    import jax

    if names_of is None:
        try:
            from orbax.checkpoint._src.tree.utils import param_name_from_keypath as names_of
        except ImportError as e:
            raise Unsupported(f"this Orbax names leaves unknown ways ({e})") from e
    flat, treedef = jax.tree_util.tree_flatten_with_path(target)
    leaves = [leaf for _, leaf in flat]
    names = [names_of(path) for path, _ in flat]
    for name, leaf in zip(names, leaves):
        if not isinstance(leaf, jax.ShapeDtypeStruct) or getattr(leaf, "sharding", None) is None:
            raise Unsupported(f"{name}: the target is not an array with a sharding")
    src = _Source(item_dir)
    try:
        stored = {k[:-len("/zarr.json")] for k in src.keys() if k.endswith("/zarr.json")}
        wanted = set(names)
        if len(wanted) != len(names) or not wanted <= stored or (
                not partial and stored != wanted):
            raise Unsupported(f"{item_dir}: holds other arrays than the target names")
        arrays = []
        for name, leaf in zip(names, leaves):
            key = name + "/zarr.json"
            try:
                meta = json.loads(src.read(key, 0, src.length(key)).tobytes())
            except ValueError as e:
                raise CheckpointError(f"{src.where(key)}: unreadable ({e})") from e
            arrays.append(_Array(name, meta, leaf, sums))
        tasks = []   # (leaf number, region, devices)
        for i, leaf in enumerate(leaves):
            regions: dict[Region, list] = {}
            for device, index in leaf.sharding.addressable_devices_indices_map(
                    leaf.shape).items():
                regions.setdefault(_region(index, leaf.shape), []).append(device)
            tasks += [(i, region, devices) for region, devices in regions.items()]
        if dry_run:
            return None
        tasks.sort(key=lambda t: src.position(_chunk_key(
            arrays[t[0]].name, [a // o for (a, _), o in zip(t[1], arrays[t[0]].outer)])))

        def one(task: tuple[int, Region, list]) -> list[tuple[Any, Any]]:
            i, region, devices = task
            values = _read_region(src, arrays[i], region)
            # the first device may wrap the buffer (zero-copy on CPU: nothing else holds it);
            # the others get copies of that (the CPU backend would wrap the same aligned
            # buffer again), so that a donating step on one never changes another
            first = jax.device_put(values, devices[0])
            return [(devices[0], first)] + [(d, jax.device_put(first, d, may_alias=False))
                                             for d in devices[1:]]

        with ThreadPoolExecutor(_THREADS, thread_name_prefix="spmd-ckpt-read") as pool:
            done = list(pool.map(one, tasks))
    finally:
        src.close()
    per_leaf: list[dict] = [{} for _ in leaves]
    for (i, _, _), pieces in zip(tasks, done):
        per_leaf[i].update(pieces)
    out = []
    for leaf, pieces in zip(leaves, per_leaf):
        devices = list(leaf.sharding.addressable_devices_indices_map(leaf.shape))
        out.append(jax.make_array_from_single_device_arrays(
            leaf.shape, leaf.sharding, [pieces[d] for d in devices]))
    return jax.tree_util.tree_unflatten(treedef, out)

