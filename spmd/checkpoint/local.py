"""The node-local tier: one blob + index per process and step, a partner copy on another node.

    <local_dir>/<step>/rank<r>.tmp/        while being written (a kill leaves only this)
    <local_dir>/<step>/rank<r>/shards.bin  this process's pieces, packed
                              index.json  every piece: leaf path, global index, offset, crc32
                              partner-rank<q>.bin/.json  the copy held for rank q (another node)
                              COMMITTED   written only after every rank agreed; crc32 of the
                                          index files, layout signature

Everything a process writes lives under its own rank directory, so wiping one process's
local storage is deleting that directory. A step counts for rank r when its COMMITTED exists.
COMMITTED names the host that wrote it (`spmd ckpt ls`, run on each node, says which node
holds what).

A restarted job may number its ranks differently on a node (a node was lost and the ranks
after it moved up): a rank that finds no directory of its own for a step also offers the
committed copies its node's other rank directories hold (`LocalTier.copies`), so that what
survives on a node's disk is found whichever rank now runs there.
COMMITTED also records `params_finite` (spmd.checkpoint.finite): retention (`prune`) never
drops the newest committed step whose parameters are finite (absent: finite).
"""

from __future__ import annotations

import logging
import os
import re
import socket
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from spmd.checkpoint.coordination import LocalVote
from spmd.checkpoint.files import (
    ChecksumError,
    crc32,
    dumps,
    fsync_dir,
    hex32,
    read_json,
    remove_tree,
    write_json_atomic,
)
from spmd.checkpoint.finite import marked_finite
from spmd.checkpoint.layout import (
    Piece,
    PieceId,
    SaveLayout,
    as_bytes,
    key_text,
    np_dtype,
)
from spmd.checkpoint.transport import Incoming, Outgoing, Transport

log = logging.getLogger("spmd.checkpoint")

FORMAT = "spmd-local/1"
MARKER = "COMMITTED"
DATA = "shards.bin"
INDEX = "index.json"
_RANK_DIR = re.compile(r"^rank(\d+)$")


def rank_name(rank: int) -> str:
    return f"rank{rank:05d}"


def partner_map(node_of_rank: Sequence[int]) -> dict[int, int]:
    """rank -> the rank on the next node (same position among its node's ranks) holding its copy.

    Empty when there is only one node: a partner on the same node protects against nothing.
    """
    nodes = sorted(set(node_of_rank))
    if len(nodes) < 2:
        return {}
    on: dict[int, list[int]] = {n: [] for n in nodes}
    for r, n in enumerate(node_of_rank):
        on[n].append(r)
    holder = {}
    for r, n in enumerate(node_of_rank):
        i = on[n].index(r)
        nxt = on[nodes[(nodes.index(n) + 1) % len(nodes)]]
        holder[r] = nxt[i % len(nxt)]
    return holder


def make_index(step: int, rank: int, layout: SaveLayout, pieces: Sequence[Piece],
               crcs: Sequence[int]) -> dict:
    entries, offset = [], 0
    for p, c in zip(pieces, crcs):
        entries.append({"leaf": p.leaf, "path": layout.paths[p.leaf], "index": list(p.key),
                        "dtype": p.dtype, "offset": offset, "nbytes": p.nbytes, "crc32": hex32(c)})
        offset += p.nbytes
    return {"format": FORMAT, "step": step, "rank": rank, "num_processes": layout.num_processes,
            "signature": layout.signature, "layout": layout.description, "dedupe": layout.dedupe,
            "file": DATA, "nbytes": offset, "pieces": entries}


class _PartnerSink:
    """Writes a partner's blob to disk as it streams in, checking every piece's crc32."""

    def __init__(self, dir: Path, source: int, fsync: bool):
        self.dir, self.source, self.fsync = dir, source, fsync
        self.base = f"partner-{rank_name(source)}"
        self.error: str | None = None
        self.index: dict | None = None
        self._f: Any = None
        self._crc: list[int] = []

    def begin(self, header: dict) -> list[int]:
        self.index = header["index"]
        sizes = [p["nbytes"] for p in self.index["pieces"]]
        self._crc = [0] * len(sizes)
        if not header.get("ok", True):  # the sender's own save failed: drain, keep nothing
            self.error = (f"no partner copy of rank {self.source}: its own save failed")
            return sizes
        try:
            self._f = open(self.dir / f"{self.base}.bin", "wb")  # noqa: SIM115
        except OSError as e:
            self.error = f"{self.dir / self.base}.bin: {e}"
        return sizes

    def chunk(self, buffer: int, offset: int, data: memoryview) -> None:
        self._crc[buffer] = crc32(data, self._crc[buffer])
        if self._f is not None and self.error is None:
            try:
                self._f.write(data)
            except OSError as e:
                self.error = f"{self.dir / self.base}.bin: {e}"

    def finish(self) -> int:
        """Close, check crcs, write the index copy; returns the crc of the index file written."""
        if self.error and self._f is None:
            raise OSError(self.error)
        if self._f is not None:
            try:
                self._f.flush()
                if self.fsync:
                    os.fsync(self._f.fileno())
            except OSError as e:
                self.error = self.error or f"{self.dir / self.base}.bin: {e}"
            self._f.close()
        if self.error:
            raise OSError(self.error)
        assert self.index is not None
        for p, c in zip(self.index["pieces"], self._crc):
            if hex32(c) != p["crc32"]:
                raise ChecksumError(self.dir / f"{self.base}.bin",
                                    f"piece {p['path']}{key_text(tuple(p['index']))} from rank "
                                    f"{self.source} arrived with crc32 {hex32(c)}, sent "
                                    f"{p['crc32']}")
        return write_json_atomic(self.dir / f"{self.base}.json", self.index, fsync=self.fsync)


@dataclass
class LocalCopy:
    """A committed copy of rank `owner`'s pieces for one step, found on this process's disk."""

    step: int
    owner: int
    data: Path
    index: Path
    index_crc: str
    signature: str = ""   # the layout signature it was saved with


class LocalTier:
    """This process's view of the node-local tier."""

    def __init__(self, root: Path, rank: int, size: int, holder_of: dict[int, int],
                 fsync: bool = True):
        self.root, self.rank, self.size, self.fsync = root, rank, size, fsync
        self.holder_of = holder_of
        self.held_for = sorted(q for q, h in holder_of.items() if h == rank)

    def step_dir(self, step: int) -> Path:
        return self.root / str(step)

    def rank_dir(self, step: int, rank: int | None = None) -> Path:
        return self.step_dir(step) / rank_name(self.rank if rank is None else rank)

    # ------------------------------------------------------------------ save

    def write(self, step: int, layout: SaveLayout, pieces: Sequence[Piece],
              arrays: Sequence[np.ndarray], transport: Transport | None, tag: int, *,
              failed: str | None = None) -> LocalVote:
        """Write this rank's pieces (and receive partner copies) into place, not yet committed.

        Always takes part in the partner exchange, even when its own disk fails or (`failed`,
        the reason) it has no host copy of its pieces at all, so partners never wait in vain.
        Returns its vote in the commit's agreement; raises nothing.
        """
        final, tmp = self.rank_dir(step), self.step_dir(step) / f"{rank_name(self.rank)}.tmp"
        t0 = time.perf_counter()
        if failed is None:
            index, nbytes, error = self._write_own(step, layout, pieces, arrays, tmp, final)
        else:        # nothing to write or send: the exchange carries an index of no pieces
            index, nbytes, error = make_index(step, self.rank, layout, [], []), 0, failed
            arrays = []
        sinks = []
        if transport is not None and self.holder_of:
            t1 = time.perf_counter()
            sinks = [_PartnerSink(tmp, q, self.fsync) for q in self.held_for]
            sends = [Outgoing(self.holder_of[self.rank], {"index": index, "ok": error is None},
                              [as_bytes(a) for a in arrays])]
            try:
                transport.exchange(sends, [Incoming(q, s) for q, s in zip(self.held_for, sinks)],
                                   tag, f"exchanging partner copies of step {step}")
            except Exception as e:
                error = error or f"rank {self.rank}: partner exchange of step {step}: {_err(e)}"
            log.debug("partner exchange of step %d took %.3f s", step, time.perf_counter() - t1)
        files, where = {}, tmp
        if error is None:
            try:
                files[INDEX] = hex32(crc32(dumps(index)))
                for s in sinks:
                    where = tmp / f"{s.base}.bin"
                    files[f"{s.base}.json"] = hex32(s.finish())
                if self.fsync:
                    fsync_dir(tmp)
                where = final
                os.rename(tmp, final)
                if self.fsync:
                    fsync_dir(final.parent)
            except Exception as e:
                error = f"rank {self.rank}: writing step {step} to {where} failed: {_err(e)}"
        if error is not None:
            return LocalVote(ok=False, error=error)
        return LocalVote(bytes=nbytes, files=files, seconds=time.perf_counter() - t0,
                         newest=self.newest_committed(below=step))

    def _write_own(self, step: int, layout: SaveLayout, pieces: Sequence[Piece],
                   arrays: Sequence[np.ndarray], tmp: Path, final: Path
                   ) -> tuple[dict, int, str | None]:
        """Data + index of this rank's pieces into `tmp`: (index, bytes written, error)."""
        nbytes, where = 0, tmp
        try:
            tmp.parent.mkdir(parents=True, exist_ok=True)
            for stale in (tmp, final):  # left by an earlier incarnation of this run
                if stale.exists() and not stale.is_dir():
                    raise NotADirectoryError(f"{stale} exists and is not a directory")
                remove_tree(stale)
            tmp.mkdir()
            where = tmp / DATA
            views = [as_bytes(a) for a in arrays]
            with ThreadPoolExecutor(max(1, min(4, (os.cpu_count() or 2) - 1))) as pool:
                sums = pool.map(crc32, views)      # on other cores while this one writes
                with open(where, "wb") as f:
                    for view in views:
                        f.write(view)
                        nbytes += view.nbytes
                    f.flush()
                    if self.fsync:
                        os.fsync(f.fileno())
                crcs = list(sums)
            index = make_index(step, self.rank, layout, pieces, crcs)
            where = tmp / INDEX
            write_json_atomic(where, index, fsync=self.fsync)
        except Exception as e:
            error = f"rank {self.rank}: writing step {step} to {where} failed: {_err(e)}"
            return make_index(step, self.rank, layout, pieces, [0] * len(pieces)), nbytes, error
        return index, nbytes, None

    def commit(self, step: int, layout: SaveLayout, files: dict[str, str], *,
               params_finite: bool | None = None) -> None:
        """Write the COMMITTED marker (after every rank agreed); `params_finite` (None:
        unknown) is recorded for retention."""
        marker = {"format": FORMAT, "step": step, "rank": self.rank, "signature": layout.signature,
                  "num_processes": layout.num_processes, "files": files,
                  "partners": [q for q in self.held_for if f"partner-{rank_name(q)}.json" in files],
                  "host": socket.gethostname(), "time": time.time()}
        if params_finite is not None:
            marker["params_finite"] = params_finite
        write_json_atomic(self.rank_dir(step) / MARKER, marker, fsync=self.fsync)

    def discard(self, step: int) -> None:
        """Remove what this rank wrote for a step that was not committed (best effort)."""
        for p in (self.rank_dir(step), self.step_dir(step) / f"{rank_name(self.rank)}.tmp"):
            try:
                if p.is_dir():
                    remove_tree(p)
            except OSError as e:
                log.warning("could not remove %s: %s", p, e)
        self._rmdir_if_empty(step)

    def _rmdir_if_empty(self, step: int) -> None:
        try:
            self.step_dir(step).rmdir()
        except OSError:
            pass  # other ranks' directories are still there

    # ------------------------------------------------------------------ scan

    def steps_on_disk(self) -> list[int]:
        if not self.root.is_dir():
            return []
        return sorted(int(p.name) for p in self.root.iterdir() if p.name.isdigit() and p.is_dir())

    def marker(self, step: int) -> dict | None:
        path = self.rank_dir(step) / MARKER
        try:
            return read_json(path)
        except (OSError, ChecksumError):
            return None

    def newest_committed(self, below: int | None = None) -> int | None:
        steps = [s for s in self.steps_on_disk() if (below is None or s < below)
                 and (self.rank_dir(s) / MARKER).is_file()]
        return steps[-1] if steps else None

    def copies(self, signature: str | Sequence[str]) -> tuple[
            dict[int, LocalCopy], dict[tuple[int, int], LocalCopy], list[str]]:
        """Committed copies matching `signature` (or one of several: each copy records which):
        own {step: copy}, held {(step, owner): copy}.

        Also returns notes on copies skipped (other layout, unreadable marker). A step with
        no directory of this rank offers the committed copies of the other rank directories
        on this disk instead (held: their own pieces and their partner copies; module doc).
        """
        signatures = {signature} if isinstance(signature, str) else set(signature)
        own: dict[int, LocalCopy] = {}
        held: dict[tuple[int, int], LocalCopy] = {}
        notes: list[str] = []
        for step in self.steps_on_disk():
            if self.rank_dir(step).is_dir():
                dirs = [(self.rank, self.rank_dir(step))]
            else:
                dirs = [(int(m.group(1)), p) for p in sorted(self.step_dir(step).iterdir())
                        if (m := _RANK_DIR.match(p.name)) and p.is_dir()]
            for writer, d in dirs:
                self._add_copies(step, writer, d, signatures, own, held, notes)
        return own, held, notes

    def _add_copies(self, step: int, writer: int, d: Path, signatures: set[str],
                    own: dict[int, LocalCopy], held: dict[tuple[int, int], LocalCopy],
                    notes: list[str]) -> None:
        """The committed copies in rank `writer`'s directory `d` of `step`."""
        try:
            m = read_json(d / MARKER)
        except (OSError, ChecksumError):
            return
        sig = m.get("signature")
        if sig not in signatures or m.get("num_processes") != self.size:
            notes.append(f"{d}: saved with another layout ({m.get('num_processes')} "
                         f"processes, signature {m.get('signature')}); not usable here")
            return
        files = m.get("files", {})
        if INDEX in files:
            copy = LocalCopy(step, writer, d / DATA, d / INDEX, files[INDEX], sig)
            if writer == self.rank:
                own[step] = copy
            else:
                held.setdefault((step, writer), copy)
        for q in m.get("partners", []):
            base = f"partner-{rank_name(q)}"
            if f"{base}.json" in files and q != self.rank:
                held.setdefault((step, q), LocalCopy(step, q, d / f"{base}.bin",
                                                     d / f"{base}.json", files[f"{base}.json"],
                                                     sig))
            elif f"{base}.json" in files:     # a copy of this rank's pieces, held here
                own.setdefault(step, LocalCopy(step, q, d / f"{base}.bin", d / f"{base}.json",
                                               files[f"{base}.json"], sig))

    # ------------------------------------------------------------------ load

    def load(self, copy: LocalCopy, layout: SaveLayout,
             buffers: dict[PieceId, np.ndarray] | None = None) -> dict[PieceId, np.ndarray]:
        """Every piece of `copy`, crc-checked; ChecksumError names the file and piece.

        Pieces are read with `readinto` straight into `buffers` (the checkpointer's reused
        snapshot buffers) where one of the right size exists, else into new arrays; the
        crc32 of a piece runs on another core while the next one is read.
        """
        index = read_json(copy.index, copy.index_crc)
        if index.get("signature") != layout.signature:
            raise ChecksumError(copy.index, "layout signature differs from its COMMITTED marker")
        size = copy.data.stat().st_size
        if size != index["nbytes"]:
            raise ChecksumError(copy.data, f"is {size} bytes, the index says {index['nbytes']}")
        buffers = buffers or {}
        out: dict[PieceId, np.ndarray] = {}
        checks = []
        with ThreadPoolExecutor(1) as pool, open(copy.data, "rb", buffering=0) as f:
            for p in index["pieces"]:
                key = tuple(tuple(k) for k in p["index"])
                pid = (p["leaf"], key)
                piece = layout.piece(pid)
                dst = buffers.get(pid)
                if dst is None or dst.nbytes != p["nbytes"] or dst.dtype != np_dtype(piece.dtype):
                    dst = np.empty(piece.shape, np_dtype(piece.dtype))
                view = as_bytes(dst)
                f.seek(p["offset"])
                got = 0
                while got < len(view):
                    n = f.readinto(view[got:])
                    if not n:
                        raise ChecksumError(copy.data, f"ended inside piece {p['path']}")
                    got += n
                checks.append((p, key, pool.submit(crc32, view)))
                out[pid] = dst
        for p, key, fut in checks:
            got_crc = hex32(fut.result())
            if got_crc != p["crc32"]:
                raise ChecksumError(copy.data, f"piece {p['path']}{key_text(key)} at offset "
                                    f"{p['offset']} has crc32 {got_crc}, the index says "
                                    f"{p['crc32']}")
        return out

    # ------------------------------------------------------------------ retention

    def prune(self, keep: int, current: int, safe: int | None) -> list[int]:
        """Drop this rank's older steps beyond the newest `keep` committed ones.

        Never drops `current`, nor any step >= `safe` (the newest step every rank is known to
        have committed before `current`): a step is only dropped when a newer one is committed
        everywhere; nor the newest committed step whose parameters are finite (its marker's
        `params_finite`, absent counting as finite). Uncommitted leftovers older than `current`
        go too. Returns dropped steps.
        """
        dropped = []
        committed = [s for s in self.steps_on_disk()
                     if s <= current and (self.rank_dir(s) / MARKER).is_file()]
        keep_set = set(committed[-keep:]) | {current}
        finite = [s for s in committed if marked_finite(self.marker(s))]
        if finite:
            keep_set.add(finite[-1])
        for step in self.steps_on_disk():
            if step >= current or step in keep_set:
                continue
            is_committed = step in committed
            if is_committed and (safe is None or step >= safe):
                continue
            for p in (self.rank_dir(step), self.step_dir(step) / f"{rank_name(self.rank)}.tmp"):
                if p.is_dir():
                    try:
                        remove_tree(p)
                    except OSError as e:
                        log.warning("could not remove old checkpoint %s: %s", p, e)
            self._rmdir_if_empty(step)
            dropped.append(step)
        return dropped

    def drop_newer(self, step: int) -> list[int]:
        """Remove this rank's directories of steps newer than `step` (an abandoned future)."""
        dropped = []
        for s in self.steps_on_disk():
            if s > step:
                self.discard(s)
                dropped.append(s)
        return dropped


def _err(e: BaseException) -> str:
    return str(e) if isinstance(e, OSError) and e.filename else f"{type(e).__name__}: {e}"
