"""Chunk checksums of Orbax's Zarr v3 writes, and their check without Orbax.

The persistent tier must vouch for every byte it commits, but reading back the files Orbax
just wrote to checksum them costs a second pass over the data (issue 40: 0.46x the disk's
rate). So every chunk's crc32c is known without that pass: for uncompressed steps (the
default; manifest format /3) spmd computes it from the host arrays while Orbax writes
(`spmd.checkpoint.chunk_sums`) and the manifest records it; for compressed steps (format /2
and all steps of format /2) TensorStore computes it while it encodes the chunk and stores it
after the chunk (Zarr v3's standard `crc32c` codec, added by `install_chunk_checksums`).
Orbax already puts a `crc32c` on each shard's index. spmd's own restore checks both kinds
(`spmd.checkpoint.reader`); TensorStore checks the codec's on every read (Orbax's restore,
a plain `ocp.StandardCheckpointer().restore`), not the manifest's, which is why spmd's
restore paths that leave a format /3 item to Orbax check it in full first.

`check_data_files` checks them without Orbax, file by file, so that `spmd ckpt verify` and the
restore's fallback name the damaged file: the item's OCDBT b-tree (TensorStore's public
`ocdbt.dump`) says which value (a Zarr shard) lies at which offset of which data file, and each
value ends in its index and the index's crc32c; each chunk the index points to ends in its
own crc32c. Bytes of a data file outside every value (per-process b-tree nodes that the
merged database no longer refers to) are never read by a restore and not checked.

The codec is added by wrapping Orbax's private `_build_zarr3_metadata` (process-wide, every
compressed Zarr v3 array Orbax writes afterwards gets it; TensorStore and zarr-python read
it). It costs: TensorStore computes it with absl's table-driven crc32c and copies each chunk
(+0.064 s of CPU per 256 MiB written, measured), which is why uncompressed steps do without.
An Orbax without that function leaves `install_chunk_checksums` False and a compressed step
is checksummed as whole files after the write, as before.
"""

from __future__ import annotations

import json
import logging
import math
import os
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from spmd.checkpoint.files import crc32c, hex32

log = logging.getLogger("spmd.checkpoint")

CRC32C_CODEC = {"name": "crc32c"}
MISSING = (1 << 64) - 1     # a chunk the shard index marks as absent (fill value)
RESIDUE = 0x48674BC7        # crc32c of any buffer followed by its own little-endian crc32c
_lock = threading.Lock()
_installed: bool | None = None


def install_chunk_checksums() -> bool:
    """Make Orbax's compressed Zarr v3 writes carry a crc32c per chunk; True when they do."""
    global _installed
    with _lock:
        if _installed is not None:
            return _installed
        try:
            from orbax.checkpoint._src.serialization import tensorstore_utils as tu

            build: Callable[..., dict] = tu._build_zarr3_metadata
        except (ImportError, AttributeError) as e:
            log.warning("this Orbax has no _build_zarr3_metadata (%s): persistent checkpoints "
                        "are checksummed by reading their files back after the write", e)
            _installed = False
            return False

        def with_chunk_crc(*args: Any, **kwargs: Any) -> dict:
            metadata = build(*args, **kwargs)
            if not kwargs.get("use_compression", args[2] if len(args) > 2 else False):
                return metadata   # uncompressed: the manifest holds the chunks' crc32c
            for codec in metadata.get("codecs", []):
                if codec.get("name") == "sharding_indexed":
                    inner = codec.setdefault("configuration", {}).setdefault("codecs", [])
                    if not any(c.get("name") == "crc32c" for c in inner):
                        inner.append(dict(CRC32C_CODEC))
            return metadata

        with_chunk_crc.spmd_chunk_crc = True  # type: ignore[attr-defined]
        if not getattr(build, "spmd_chunk_crc", False):
            tu._build_zarr3_metadata = with_chunk_crc
        _installed = True
        return True


def _node(kv: Any, location: str | None = None) -> dict:
    import tensorstore as ts

    return ts.ocdbt.dump(kv, location).result() if location else ts.ocdbt.dump(kv).result()


def _key(raw: Any) -> str:
    """A b-tree key as ocdbt.dump gives it (bytes, or the text "b'...'")."""
    if isinstance(raw, bytes):
        return raw.decode(errors="replace")
    text = str(raw)
    return text[2:-1] if text.startswith(("b'", 'b"')) else text


def _inline(raw: Any) -> bytes:
    if isinstance(raw, bytes):
        return raw
    import ast

    return ast.literal_eval(raw) if str(raw).startswith(("b'", 'b"')) else str(raw).encode()


def item_values(item_dir: Path) -> tuple[dict[str, list[tuple[int, int, str]]], dict[str, bytes]]:
    """The values of an Orbax item's (merged) OCDBT database.

    Returns ({data file relative to `item_dir`: [(offset, length, key)]}, {key: inline value}).
    Raises when the database cannot be read (a damaged manifest or b-tree node).
    """
    import tensorstore as ts

    kv = ts.KvStore.open({"driver": "file", "path": str(item_dir) + "/"}).result()
    top = _node(kv)
    versions = top.get("versions") or []
    if not versions:
        return {}, {}
    refs: dict[str, list[tuple[int, int, str]]] = {}
    inline: dict[str, bytes] = {}
    pending = [versions[-1]["root"]["location"]]
    while pending:
        node = _node(kv, pending.pop())
        for entry in node.get("entries", []):
            ref = entry.get("indirect_value")
            child = entry.get("location") or entry.get("node")
            if ref:   # value:<prefix>:d/<file>:<offset>:<length>
                _, prefix, name, offset, length = str(ref).rsplit(":", 4)
                refs.setdefault(prefix + name, []).append(
                    (int(offset), int(length), _key(entry.get("key"))))
            elif "inline_value" in entry:
                inline[_key(entry.get("key"))] = _inline(entry["inline_value"])
            elif child:   # an interior node's child
                pending.append(str(child))
    for values in refs.values():
        values.sort()
    return refs, inline


def _array_of(key: str) -> str:
    """'params/w/c/0/1' -> 'params/w' (Zarr v3's default chunk key encoding)."""
    head, sep, _ = key.rpartition("/c/")
    return head if sep else key.rsplit("/", 1)[0]


def _shard_layout(zarr_json: bytes) -> tuple[int, bool] | None:
    """(chunks per shard, chunks carry crc32c) of a sharded Zarr v3 array; None: not sharded
    with a crc32c index (nothing this module can check)."""
    meta = json.loads(zarr_json)
    outer = meta.get("chunk_grid", {}).get("configuration", {}).get("chunk_shape", [])
    for codec in meta.get("codecs", []):
        if codec.get("name") != "sharding_indexed":
            continue
        config = codec.get("configuration", {})
        if config.get("index_location", "end") != "end" or not any(
                c.get("name") == "crc32c" for c in config.get("index_codecs", [])):
            return None
        inner = config.get("chunk_shape", [])
        n = math.prod(math.ceil(o / i) for o, i in zip(outer, inner)) if inner else 1
        return n, any(c.get("name") == "crc32c" for c in config.get("codecs", []))
    return None


def chunk_problem(i: int, chunk: Any, want: str | None) -> str | None:
    """What is wrong with chunk `i` of a shard, else None: `chunk` its stored bytes (None: the
    shard's index marks it absent), `want` the step manifest's crc32c of it (format /3), or
    None when the chunk ends in its own crc32c (the codec: formats /2, compressed steps). The
    one check of a chunk, for spmd's reader and the file-by-file check alike."""
    if want is None:
        return None if chunk is None or crc32c(chunk) == RESIDUE else \
            f"chunk {i} fails its crc32c"
    if chunk is None:   # Orbax stores every chunk (store_data_equal_to_fill_value)
        return f"its index marks chunk {i} absent, the step's manifest has its crc32c"
    return None if hex32(crc32c(chunk)) == want else \
        f"chunk {i} fails its crc32c (the manifest's)"


def _check_value(f: Any, offset: int, length: int, chunks: int, chunk_crc: bool,
                 want: str | None = None) -> str | None:
    """Problem with the Zarr shard at `offset` of open file `f` (index at its end, crc32c
    checked; each chunk ends in its crc32c, or, one chunk per shard, has the crc32c `want`
    from the step's manifest), else None. Reads each byte once, no copies: a buffer followed
    by its little-endian crc32c has the crc32c `RESIDUE`."""
    size = 16 * chunks + 4
    if length < size:
        return f"{length} bytes, too short for a shard index of {chunks} chunk(s)"
    f.seek(offset + length - size)
    index = f.read(size)
    if len(index) != size or crc32c(index) != RESIDUE:
        return "its shard index fails its crc32c"
    if not chunk_crc and (want is None or chunks != 1):
        return ("its chunks carry no crc32c and the step's manifest has none for it"
                if want is None else f"{chunks} chunks per shard carry no crc32c")
    for i in range(chunks):
        start, nbytes = struct.unpack_from("<QQ", index, 16 * i)
        chunk = None
        if not (start == MISSING and nbytes == MISSING):
            if nbytes < (4 if chunk_crc else 0) or start + nbytes > length - size:
                return f"chunk {i} lies outside the shard ({start}+{nbytes})"
            f.seek(offset + start)
            chunk = f.read(nbytes)
            if len(chunk) != nbytes:
                return f"chunk {i} lies outside the file"
        problem = chunk_problem(i, chunk, None if chunk_crc else want)
        if problem is not None:
            return problem
    return None


def chunk_checked(item_dir: Path) -> tuple[dict[str, list[tuple[int, int, str]]],
                                           dict[str, tuple[int, bool]]]:
    """(values by data file, {array: (chunks per shard, chunk crc)}) of an item."""
    refs, inline = item_values(item_dir)
    layouts: dict[str, tuple[int, bool]] = {}
    for key, value in inline.items():
        if key.endswith("zarr.json"):
            layout = _shard_layout(value)
            if layout is not None:
                layouts[key.rsplit("/", 1)[0] if "/" in key else ""] = layout
    for name, values in refs.items():   # a zarr.json too large to be inline
        for offset, length, key in values:
            if key.endswith("zarr.json"):
                with open(item_dir / name, "rb") as f:
                    f.seek(offset)
                    layout = _shard_layout(f.read(length))
                if layout is not None:
                    layouts[key.rsplit("/", 1)[0] if "/" in key else ""] = layout
    return refs, layouts


def check_data_file(path: Path, values: list[tuple[int, int, str]],
                    layouts: dict[str, tuple[int, bool]],
                    sums: dict[str, str] | None = None) -> str | None:
    """Problem with one data file's values (each chunk read once), naming it; else None.
    `sums`: the manifest's {chunk key: crc32c} of the item (format /3)."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            for offset, length, key in values:
                if offset + length > size:
                    return (f"{path}: holds {size} bytes, the checkpoint's b-tree has {key} at "
                            f"{offset}+{length}")
                if key.endswith("zarr.json"):
                    continue
                layout = layouts.get(_array_of(key))
                if layout is None:
                    return f"{path}: {key} is not a crc32c-indexed Zarr shard (cannot be checked)"
                why = _check_value(f, offset, length, *layout, (sums or {}).get(key))
                if why is not None:
                    return f"{path}: {key} at {offset}+{length}: {why}"
    except OSError as e:
        return f"{path}: cannot be read ({e.strerror or e})"
    return None
