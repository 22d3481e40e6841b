"""Bulk bytes between ranks over MPI point-to-point, streamed in chunks, never waiting forever.

Used for partner copies (each rank sends its shard blob to a rank on another node) and for
moving pieces during a node-local restore. Every message goes on a private duplicate of
COMM_WORLD, so nothing else in the job can match it. A transfer fails when no request makes
progress for `timeout_s`; the error names the ranks whose messages were still pending.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from spmd.checkpoint.coordination import CheckpointTimeout
from spmd.checkpoint.interface import CheckpointError
from spmd.comm.agreement import ranks_text

CHUNK = 32 << 20      # bytes per message
WINDOW = 4            # messages in flight per peer and direction


class Sink(Protocol):
    def begin(self, header: dict) -> list[int]:
        """Header received: return the byte size of every buffer that follows."""

    def chunk(self, buffer: int, offset: int, data: memoryview) -> None:
        """The next bytes of `buffer`, in order (data is only valid during the call)."""


@dataclass
class Outgoing:
    dest: int
    header: dict
    buffers: Sequence[Any]   # contiguous byte buffers (memoryview / uint8 arrays)


@dataclass
class Incoming:
    source: int
    sink: Sink
    header: dict | None = None


def _chunks(sizes: Sequence[int]) -> list[tuple[int, int, int]]:
    """(buffer, offset, length) of every message for buffers of `sizes` (empty ones: none)."""
    out = []
    for b, n in enumerate(sizes):
        for off in range(0, n, CHUNK):
            out.append((b, off, min(CHUNK, n - off)))
    return out


@dataclass
class _Send:
    out: Outgoing
    pending: deque = field(default_factory=deque)   # chunk descriptors not yet posted
    inflight: deque = field(default_factory=deque)  # requests
    started: bool = False


@dataclass
class _Recv:
    inc: Incoming
    length: np.ndarray = field(default_factory=lambda: np.zeros(1, np.int64))
    header_buf: np.ndarray | None = None
    req: Any = None
    stage: str = "length"   # length -> header -> data -> done
    pending: deque = field(default_factory=deque)
    inflight: deque = field(default_factory=deque)  # (req, buf, (buffer, offset, length))
    pool: list = field(default_factory=list)


class Transport:
    """Streams between ranks on a private communicator (one per checkpointer)."""

    def __init__(self, comm: Any, rank: int, timeout_s: float):
        self.comm, self.rank, self.timeout_s = comm, rank, timeout_s

    @classmethod
    def create(cls, world: Any, rank: int, size: int, timeout_s: float) -> Transport | None:
        """A transport on a duplicate of `world`, or None when MPI does not match the job."""
        if world is None or world.Get_size() != size or world.Get_rank() != rank or size < 2:
            return None
        from mpi4py import MPI

        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            return None  # background saves would call MPI from a second thread
        comm, req = world.Idup()
        _wait_one(req, timeout_s, f"rank {rank}: duplicating the MPI communicator for "
                                  "checkpoint transfers")
        # Idup can complete on one rank (rank 0) before the others, and an MPI without
        # asynchronous progress (MPICH over libfabric's tcp provider, across nodes) completes
        # theirs only while that rank still calls into MPI: a barrier on the new communicator
        # keeps every rank here until all have it (seen as a hang of every other node in the
        # next barrier outside MPI, Orbax's)
        _wait_one(comm.Ibarrier(), timeout_s, f"rank {rank}: waiting for every rank to "
                                               "duplicate the MPI communicator")
        return cls(comm, rank, timeout_s)

    def exchange(self, sends: Sequence[Outgoing], recvs: Sequence[Incoming], tag: int,
                 what: str) -> None:
        """Run all `sends` and `recvs` to completion; `what` goes into error messages."""
        from mpi4py import MPI

        comm = self.comm
        hdr_tag, data_tag = 2 * tag, 2 * tag + 1
        keep: list[Any] = []  # buffers of requests in flight must outlive them
        sstates = [_Send(o) for o in sends]
        for s in sstates:
            body = json.dumps(s.out.header).encode()
            length = np.array([len(body)], np.int64)
            keep += [length, body]
            s.inflight.append(comm.Isend([length, MPI.BYTE], s.out.dest, hdr_tag))
            s.inflight.append(comm.Isend([body, MPI.BYTE], s.out.dest, hdr_tag))
            s.pending.extend(_chunks([memoryview(b).nbytes for b in s.out.buffers]))
        rstates = [_Recv(i) for i in recvs]
        for r in rstates:
            r.req = comm.Irecv([r.length, MPI.BYTE], r.inc.source, hdr_tag)

        last_progress = time.monotonic()
        pause = 0.0
        while True:
            progressed = False
            busy = False
            for s in sstates:
                while s.inflight and s.inflight[0].Test():
                    s.inflight.popleft()
                    progressed = True
                while s.pending and len(s.inflight) < WINDOW + 2:
                    b, off, n = s.pending.popleft()
                    view = memoryview(s.out.buffers[b]).cast("B")[off:off + n]
                    s.inflight.append(comm.Isend([view, MPI.BYTE], s.out.dest, data_tag))
                busy |= bool(s.inflight or s.pending)
            for r in rstates:
                progressed |= self._step_recv(r, hdr_tag, data_tag)
                busy |= r.stage != "done"
            if not busy:
                return
            now = time.monotonic()
            if progressed:
                last_progress, pause = now, 0.0
                continue
            if now - last_progress > self.timeout_s:
                peers = sorted({s.out.dest for s in sstates if s.inflight or s.pending}
                               | {r.inc.source for r in rstates if r.stage != "done"})
                for s in sstates:
                    for req in s.inflight:
                        _cancel(req)
                for r in rstates:
                    _cancel(r.req)
                    for req, _, _ in r.inflight:
                        _cancel(req)
                raise CheckpointTimeout(
                    f"rank {self.rank}: no progress for {self.timeout_s:.0f} s while {what} "
                    f"with rank(s) {ranks_text(peers)} over MPI (checkpoint.timeout_s); "
                    "they may have died or hung - check their logs")
            time.sleep(pause)
            pause = min(0.002, pause + 0.0001)

    def _step_recv(self, r: _Recv, hdr_tag: int, data_tag: int) -> bool:
        from mpi4py import MPI

        comm, progressed = self.comm, False
        if r.stage == "length" and r.req.Test():
            r.header_buf = np.empty(int(r.length[0]), np.uint8)
            r.req = comm.Irecv([r.header_buf, MPI.BYTE], r.inc.source, hdr_tag)
            r.stage, progressed = "header", True
        if r.stage == "header" and r.req.Test():
            r.inc.header = json.loads(bytes(r.header_buf))
            sizes = r.inc.sink.begin(r.inc.header)
            r.pending.extend(_chunks(sizes))
            r.pool = [np.empty(min(CHUNK, max(sizes or [0])), np.uint8)
                      for _ in range(min(WINDOW, len(r.pending)))]
            r.stage, progressed = "data", True
        if r.stage == "data":
            while r.inflight and r.inflight[0][0].Test():
                _, buf, (b, off, n) = r.inflight.popleft()
                r.inc.sink.chunk(b, off, memoryview(buf)[:n])
                r.pool.append(buf)
                progressed = True
            while r.pending and r.pool:
                b, off, n = r.pending.popleft()
                buf = r.pool.pop()
                req = comm.Irecv([memoryview(buf)[:n], MPI.BYTE], r.inc.source, data_tag)
                r.inflight.append((req, buf, (b, off, n)))
            if not r.pending and not r.inflight:
                r.stage, progressed = "done", True
        return progressed


def _cancel(req: Any) -> None:
    try:
        if req is not None:
            req.Cancel()
    except Exception:
        pass


def _wait_one(req: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not req.Test():
        if time.monotonic() > deadline:
            raise CheckpointTimeout(f"{what}: timed out after {timeout_s:.0f} s (another rank "
                                    "did not join; checkpoint.timeout_s)")
        time.sleep(0.001)


class CollectSink:
    """Keeps every buffer of one message in memory (for small headers or restore pieces)."""

    def __init__(self, targets: list[np.ndarray] | None = None):
        self.targets = targets
        self.header: dict | None = None

    def begin(self, header: dict) -> list[int]:
        self.header = header
        if self.targets is None:
            self.targets = [np.empty(n, np.uint8) for n in header["sizes"]]
        sizes = [t.nbytes for t in self.targets]
        if sizes != list(header["sizes"]):
            raise CheckpointError(f"expected buffers of {sizes} bytes, the sender announced "
                                  f"{header['sizes']}")
        return sizes

    def chunk(self, buffer: int, offset: int, data: memoryview) -> None:
        dest = self.targets[buffer].reshape(-1).view(np.uint8)
        dest[offset:offset + data.nbytes] = np.frombuffer(data, np.uint8)
