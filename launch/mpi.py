"""MPI, only when the job was started by an MPI launcher, and collectives that cannot hang.

`world()` imports mpi4py (which initializes MPI) only when SPMD_MPI=1, or when SPMD_MPI is
unset and a launcher left its PMI/PMIx/Open MPI variables; SPMD_MPI=0 never uses MPI. Every
collective here is non-blocking and polled against a deadline, raising LaunchError on expiry.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from spmd.launch.errors import LaunchError

MPI_HINTS = ("PMI_RANK", "PMI_FD", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE",
             "MV2_COMM_WORLD_SIZE", "PALS_RANKID", "JSM_NAMESPACE_SIZE")
WIDTH = 512  # bytes per string in string collectives

_state: dict[str, Any] = {}


def wanted(environ: Mapping[str, str]) -> tuple[bool, str]:
    """Whether to use MPI here, and why."""
    flag = environ.get("SPMD_MPI", "").strip().lower()
    if flag in ("0", "false", "no", "off"):
        return False, "SPMD_MPI=0"
    if flag in ("1", "true", "yes", "on"):
        return True, "SPMD_MPI=1"
    hint = next((h for h in MPI_HINTS if environ.get(h)), None)
    return (True, f"{hint} is set") if hint else (False, "no MPI launcher variables")


def world(environ: Mapping[str, str] | None = None) -> Any:
    """mpi4py's COMM_WORLD if MPI is wanted and importable, else None (cached)."""
    if "comm" in _state:
        return _state["comm"]
    want, why = wanted(os.environ if environ is None else environ)
    comm = None
    if want:
        try:
            from mpi4py import MPI

            comm = MPI.COMM_WORLD
            why = f"{why}; {library_name()}"
        except ImportError as e:  # mpi4py is a dependency, but be kind to odd installs
            why = f"{why}, but mpi4py cannot be imported ({e})"
    _state.update(comm=comm, why=why)
    return comm


def why() -> str:
    """Why `world()` did or did not use MPI."""
    return _state.get("why", "not asked")


def library_name() -> str:
    from mpi4py import MPI

    return " ".join(MPI.Get_library_version().strip().splitlines()[0].split())


def _wait(req: Any, timeout_s: float, who: str, what: str) -> None:
    start = time.monotonic()
    deadline = start + timeout_s
    pause = 0.0
    while not req.Test():
        now = time.monotonic()
        if now - start < 0.001:
            continue  # spin briefly: most collectives finish within microseconds
        if now > deadline:
            raise LaunchError(
                f"{who}: timed out after {timeout_s:.0f} s waiting for all ranks to {what} over "
                "MPI: a rank may have died, hung, or never started; check the other ranks' logs")
        time.sleep(pause)
        pause = min(0.001, pause + 0.00005)


def _encode(text: str) -> np.ndarray:
    raw = text.encode()[:WIDTH]
    buf = np.zeros(WIDTH, dtype=np.uint8)
    buf[: len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    return buf


def _decode(buf: np.ndarray) -> str:
    return bytes(buf).rstrip(b"\0").decode(errors="replace")


def allgather_str(comm: Any, text: str, timeout_s: float, who: str, what: str) -> list[str]:
    """Every rank's `text`, in rank order."""
    out = np.zeros((comm.Get_size(), WIDTH), dtype=np.uint8)
    _wait(comm.Iallgather(_encode(text), out), timeout_s, who, what)
    return [_decode(row) for row in out]


def bcast_str(comm: Any, text: str, root: int, timeout_s: float, who: str, what: str) -> str:
    """`text` of rank `root` on every rank."""
    buf = _encode(text)
    _wait(comm.Ibcast(buf, root=root), timeout_s, who, what)
    return _decode(buf)


def allreduce_max(comm: Any, values: np.ndarray, timeout_s: float, who: str,
                  what: str) -> np.ndarray:
    """Element-wise maximum over ranks of an int64 vector."""
    from mpi4py import MPI

    send = np.ascontiguousarray(values, dtype=np.int64)
    out = np.empty_like(send)
    _wait(comm.Iallreduce(send, out, op=MPI.MAX), timeout_s, who, what)
    return out
