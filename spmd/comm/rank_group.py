"""`RankGroup`: every rank of the job, and the one channel they talk over.

Collectives that every rank calls, at the same point of its program and in the same order:
`broadcast_str` (one rank's text on every rank), `allgather_str` (every rank's text on every
rank, in rank order) and `allreduce_max` (the element-wise maximum of a few integers). They
travel over MPI when the job has an MPI world of the job's size (`spmd.launch.mpi.world()`,
as bootstrap found it), else over the jax.distributed key-value store (`spmd.comm.kvstore`);
one process needs neither.

Invariants
- No wait is unbounded: each one gives up after `timeout_s` with a LaunchError (the launch
  layer's error, whichever channel carried the call) that names this rank and host
  (`env.who`), what it waited for, and the config key that sets the timeout.
- The channel is chosen at the first collective and kept: every rank of a job sees the same
  MPI world, so all ranks pick the same one.
- On the key-value store, keys live under `spmd/<name>/<call number>/`: `name` keeps two
  groups apart, the call number two calls of one group. A rank deletes its reduce or gather
  entry of the previous such call once the next such call's barrier shows every rank has
  read it (so at most one entry per rank is left per group); a broadcast leaves its one key
  behind (broadcasts are rare: a run's lease, a stop reason).
- Strings are at most `spmd.launch.mpi.WIDTH` bytes (longer ones are cut) on both channels.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from spmd.comm.kvstore import kv_client
from spmd.launch import mpi
from spmd.launch.env import LaunchEnv
from spmd.launch.errors import LaunchError

_UNSET = object()


class RankGroup:
    """All `env.size` ranks; every wait bounded by `timeout_s` (the config key `timeout_key`)."""

    def __init__(self, env: LaunchEnv, timeout_s: float, timeout_key: str, name: str):
        self.env, self.timeout_s, self.timeout_key, self.name = env, timeout_s, timeout_key, name
        self._comm: Any = _UNSET
        self._calls = 0
        self._posted: str | None = None  # our reduce entry of the previous call

    @property
    def channel(self) -> str:
        """"single" (one rank), "mpi" or "kv" (the jax.distributed key-value store)."""
        if self.env.size == 1:
            return "single"
        return "mpi" if self._mpi() is not None else "kv"

    def broadcast_str(self, text: str, root: int, what: str) -> str:
        """Rank `root`'s `text` on every rank. `what` completes "could not ..." in errors."""
        self._calls += 1
        if self.env.size == 1:
            return text
        comm = self._mpi()
        if comm is not None:
            return self._over_mpi(mpi.bcast_str, comm, text, root, what=what)
        client, key = self._client(what), f"spmd/{self.name}/{self._calls}/bcast"
        try:
            if self.env.rank == root:
                text = text.encode()[:mpi.WIDTH].decode(errors="replace")  # as over MPI
                client.key_value_set(key, text)
                return text
            return str(client.blocking_key_value_get(key, int(self.timeout_s * 1000)))
        except Exception as e:  # the client raises its own runtime error type
            raise self._kv_error(what, e) from e

    def allreduce_max(self, values: Sequence[int], what: str) -> list[int]:
        """The element-wise maximum of every rank's `values` (the same length on all ranks)."""
        self._calls += 1
        if self.env.size == 1:
            return [int(v) for v in values]
        comm = self._mpi()
        if comm is not None:
            out = self._over_mpi(mpi.allreduce_max, comm, np.array(values, dtype=np.int64),
                                 what=what)
            return [int(v) for v in out]
        rows = [json.loads(v) for _, v in
                self._post_and_read("max", json.dumps([int(v) for v in values]), what)]
        return [max(column) for column in zip(*rows, strict=True)]

    def allgather_str(self, text: str, what: str) -> list[str]:
        """Every rank's `text`, in rank order, on every rank. `what` completes "could not ..."."""
        self._calls += 1
        comm = self._mpi() if self.env.size > 1 else None
        if comm is not None:
            return self._over_mpi(mpi.allgather_str, comm, text, what=what)
        text = text.encode()[:mpi.WIDTH].decode(errors="replace")  # as over MPI
        if self.env.size == 1:
            return [text]
        rows = self._post_and_read("gather", text, what)
        by_rank = {int(key.rsplit("/", 1)[1]): value for key, value in rows}
        if sorted(by_rank) != list(range(self.env.size)):
            raise LaunchError(f"{self.env.who}: could not {what}: the key-value store holds "
                              f"entries of ranks {sorted(by_rank)} for {self.env.size} ranks")
        return [str(by_rank[r]) for r in range(self.env.size)]

    def _post_and_read(self, kind: str, value: str, what: str) -> list[tuple[str, str]]:
        """kv channel: post this rank's `value`, wait for every rank, read every entry (key,
        value) of this call; then delete our entry of the previous such call."""
        client, prefix = self._client(what), f"spmd/{self.name}/{self._calls}/{kind}"
        try:
            client.key_value_set(f"{prefix}/{self.env.rank}", value)
            # One reused barrier id (jax keeps a counter per id), so nothing grows per call.
            client.wait_at_barrier(f"spmd/{self.name}", int(self.timeout_s * 1000))
            rows = list(client.key_value_dir_get(f"{prefix}/"))
            if self._posted is not None:  # every rank is past the call that read it
                client.key_value_delete(self._posted)
            self._posted = f"{prefix}/{self.env.rank}"
        except Exception as e:  # the client raises its own runtime error type
            raise self._kv_error(what, e) from e
        return rows

    def _mpi(self) -> Any:
        """The MPI world when it spans exactly this job's ranks, else None (decided once)."""
        if self._comm is _UNSET:
            comm = mpi.world()
            self._comm = comm if comm is not None and comm.Get_size() == self.env.size else None
        return self._comm

    def _over_mpi(self, collective: Any, comm: Any, *args: Any, what: str) -> Any:
        try:
            return collective(comm, *args, self.timeout_s, self.env.who, what)
        except LaunchError as e:
            wait = f"the wait is {self.timeout_key}={self.timeout_s:g} s"
            raise LaunchError(f"{e} ({wait})") from None

    def _client(self, what: str) -> Any:
        client = kv_client()
        if client is None:
            raise LaunchError(f"{self.env.who}: cannot {what}: {self.env.size} ranks need MPI or "
                              "an initialized jax.distributed; call bootstrap() first")
        return client

    def _kv_error(self, what: str, e: Exception) -> LaunchError:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return LaunchError(f"{self.env.who}: could not {what} with all {self.env.size} ranks "
                           f"within {self.timeout_s:.0f} s ({self.timeout_key}) over "
                           f"jax.distributed: {first}")
