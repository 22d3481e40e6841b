"""Zarr v3 records read straight from their chunk files: one file read and one decode per
record, no trip through zarr's event loop.

Why: a synchronous zarr 3 read hands every selection to zarr's event-loop thread and runs
each chunk through its asyncio codec pipeline: 0.5-1 ms per 16 KiB chunk on the 2-core
development machine, where reading the chunk file and decoding it with the same numcodecs
codec costs about 0.1 ms. A Zarr array written with one record per chunk (as
`spmd.data.write_arrays` writes it) keeps record `r` in the chunk file named by its chunk
key encoding for chunk `(r, 0, ..., 0)`; `ChunkRecords.find` checks once that the array is of
that kind and `read` reads records straight into the caller's batch buffer. Chunk files of
a cold batch are announced to the kernel together (`posix_fadvise(WILLNEED)`), so that they
are fetched concurrently.

Invariants:
- Used only where a chunk file's decoded bytes are the record's values: a Zarr v3 array in
  a local directory store (`zarr.storage.LocalStore`), a regular chunk grid of one record
  per chunk holding the whole record, a fixed-size integer or float dtype, the `bytes`
  codec in native byte order followed only by `zstd`, `gzip` or `blosc` (decoded by the
  numcodecs codec zarr itself uses). `ChunkRecords.find` returns None for anything else
  (sharding, transposes, checksums, Zarr v2, remote stores, ...), with the reason, and after
  building a reader checks it: the first and last records read both ways must be equal,
  else None. The layout is read from the metadata as the Zarr v3 spec writes it, so a zarr
  release that moves its classes does not turn the reader off.
  The caller reads through zarr wherever there is no reader: the values are the same.
- A record whose chunk file does not exist (zarr does not write a chunk that holds only
  the fill value) is left to the caller, which reads the fill value through zarr.
- A chunk file that does not decode to exactly one record raises ShortRead naming the file.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from spmd.data.formats.direct_reads import WILLNEED, ShortRead, read_cached

__all__ = ["ChunkRecords"]



def _decoder(codec: Any) -> Callable[[bytes], Any] | None:
    """The numcodecs decode function of a zarr bytes-to-bytes codec; None if unsupported."""
    import numcodecs
    from zarr.codecs import BloscCodec, GzipCodec, ZstdCodec

    if isinstance(codec, ZstdCodec):
        return numcodecs.Zstd(level=codec.level, checksum=codec.checksum).decode
    if isinstance(codec, GzipCodec):
        return numcodecs.GZip(level=codec.level).decode
    if isinstance(codec, BloscCodec):
        return numcodecs.Blosc().decode            # blosc frames describe themselves
    return None


@dataclass(frozen=True)
class ChunkRecords:
    """The records of one Zarr v3 array, one chunk file each."""

    directory: Path                      # the array's directory in the store
    chunk_key: Callable[[tuple[int, ...]], str]
    ndim: int
    dtype: np.dtype
    row_bytes: int
    decoders: tuple[Callable[[bytes], Any], ...]
    codec_names: tuple[str, ...] = ()

    def path(self, row: int) -> Path:
        return self.directory / self.chunk_key((row,) + (0,) * (self.ndim - 1))

    @classmethod
    def find(cls, array: Any) -> tuple[ChunkRecords | None, str]:
        """The reader of a zarr Array, checked against zarr itself, or None where its records
        cannot be read straight from chunk files; and why: "direct chunk reads (...)" or what
        keeps this array from them, in words for `spmd data info`."""
        try:
            found = cls._find(array)
            if isinstance(found, str):
                return None, found
            if not found._agrees(array):
                return None, ("a record read from its chunk file differs from zarr's read of "
                              "it (a codec spmd decodes differently)")
        except (OSError, RuntimeError, ValueError, TypeError, AttributeError, KeyError,
                ImportError) as e:                    # another zarr, a foreign store, ...
            return None, f"zarr {_zarr_version()} answered {type(e).__name__}: {e}"
        codecs = "+".join(["bytes", *found.codec_names])
        return found, f"direct chunk reads: one record per chunk file, {codecs}"

    @classmethod
    def _find(cls, array: Any) -> ChunkRecords | str:
        """The reader, or why there is none. Reads the array's metadata as the Zarr v3 spec
        writes it (`to_dict()`), not zarr's Python classes, which move between releases."""
        from zarr.codecs import BytesCodec
        from zarr.storage import LocalStore

        meta = array.metadata
        store = array.store_path.store
        dtype, shape = np.dtype(array.dtype), tuple(array.shape)
        if meta.zarr_format != 3:
            return f"a Zarr v{meta.zarr_format} array (chunk files are read directly in v3)"
        if not isinstance(store, LocalStore):
            return f"a {type(store).__name__} (chunk files are read directly from a local one)"
        if dtype.kind not in "iuf":
            return f"dtype {dtype} (chunk files are read directly for integers and floats)"
        if len(shape) < 1 or shape[0] == 0:
            return f"shape {shape}: no records"
        first, *rest = meta.codecs
        if not isinstance(first, BytesCodec):
            return f"codec {type(first).__name__} before the bytes (sharding or a transpose)"
        grid = meta.to_dict().get("chunk_grid", {})
        chunks = tuple(grid.get("configuration", {}).get("chunk_shape", ()))
        if grid.get("name") != "regular" or chunks != (1, *shape[1:]):
            return (f"chunks {chunks or grid.get('name')}, not one record "
                    f"{(1, *shape[1:])} each (spmd data rechunk writes that layout)")
        endian = getattr(first.endian, "value", first.endian)
        if dtype.itemsize > 1 and endian != ("little" if np.little_endian else "big"):
            return f"{endian}-endian bytes on a {'little' if np.little_endian else 'big'}-" \
                   f"endian machine"
        decoders = tuple(_decoder(c) for c in rest)
        if any(d is None for d in decoders):
            names = [type(c).__name__ for c, d in zip(rest, decoders) if d is None]
            return f"codec {', '.join(names)} (chunk files are read directly with zstd, " \
                   f"gzip or blosc)"
        return cls(Path(store.root) / array.store_path.path,
                   meta.chunk_key_encoding.encode_chunk_key, len(shape), dtype.newbyteorder("="),
                   int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize, decoders,
                   tuple(type(c).__name__.removesuffix("Codec").lower() for c in rest))

    def _agrees(self, array: Any) -> bool:
        """The first and last records whose chunk files exist read the same both ways."""
        rows = [r for r in (0, array.shape[0] - 1) if self.path(r).is_file()]
        for row in set(rows):
            mine = np.empty(array.shape[1:], dtype=self.dtype)
            if self.read([row], [mine])[0] or mine.tobytes() != np.asarray(array[row]).tobytes():
                return False
        return True

    def read(self, rows: list[int], buffers: list[np.ndarray]) -> tuple[list[int], int]:
        """Record `rows[k]` into `buffers[k]` (a C-contiguous record of `dtype`); returns the
        k left unread (no chunk file: the fill value, read through zarr) and how many chunk
        files were not in the page cache."""
        fds: list[int | None] = []
        left: list[int] = []
        try:
            for k, row in enumerate(rows):
                try:
                    fds.append(os.open(self.path(row), os.O_RDONLY))
                except FileNotFoundError:
                    fds.append(None)
                    left.append(k)
            data = [None if fd is None else _read_cached(fd) for fd in fds]
            misses = [k for k, (fd, got) in enumerate(zip(fds, data))
                      if fd is not None and got is None]
            if WILLNEED is not None and len(misses) > 1:
                for k in misses:
                    os.posix_fadvise(fds[k], 0, 0, WILLNEED)
            for k in misses:
                data[k] = os.pread(fds[k], os.fstat(fds[k]).st_size, 0)
            for k, got in enumerate(data):
                if got is not None:
                    self._decode_into(k, rows[k], got, buffers[k])
        finally:
            for fd in fds:
                if fd is not None:
                    os.close(fd)
        return left, len(misses)

    def advise(self, rows: list[int]) -> None:
        """Tell the kernel that the chunk files of records `rows` will be read soon."""
        if WILLNEED is None:
            return
        for row in rows:
            try:
                fd = os.open(self.path(row), os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, WILLNEED)
            finally:
                os.close(fd)

    def _decode_into(self, k: int, row: int, data: Any, buffer: np.ndarray) -> None:
        try:
            for decode in reversed(self.decoders):
                data = decode(data)
            raw = memoryview(data).cast("B")
        except (RuntimeError, ValueError, TypeError) as e:
            raise ShortRead(k, f"chunk file {self.path(row)} does not decode ({e}): "
                               f"damaged?") from None
        if raw.nbytes != self.row_bytes:
            raise ShortRead(k, f"chunk file {self.path(row)} decodes to {raw.nbytes} bytes, "
                               f"not the record's {self.row_bytes} (damaged or truncated?)")
        buffer.reshape(-1).view(np.uint8)[:] = np.frombuffer(raw, dtype=np.uint8)



def _zarr_version() -> str:
    try:
        import zarr

        return zarr.__version__
    except ImportError:
        return "(not installed)"


def _read_cached(fd: int) -> bytearray | None:
    """The whole file if the page cache holds it, else None."""
    buffer = bytearray(os.fstat(fd).st_size)
    return buffer if read_cached(fd, buffer, 0) == len(buffer) else None
