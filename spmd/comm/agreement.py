"""Agreement among ranks with a timeout that names who was waited for.

Every rank posts a small JSON vote to the jax.distributed key-value store (the service every
multi-process JAX job already runs); rank 0 polls for all votes, decides, and posts the
decision, which every other rank reads. Rank 0 knows exactly which ranks are missing when it
gives up, and says so in the decision that the others then raise. No MPI is needed, so this
works under every launcher, from any thread, and the store never blocks forever.

Invariants
- Every rank calls `agree` on a channel in the same order; the n-th call of every rank
  meets the others' n-th (keys `spmd/<namespace>/<channel>/<n>/...`). n counts per process,
  not per object: a second coordinator on a channel (a second checkpointer in one job, e.g.
  restoring two runs) goes on from the first one's count, so it never meets old keys.
- No wait is unbounded: rank 0 gives up after `timeout_s` and names the missing ranks and
  `timeout_key`; the others wait a little longer for rank 0's word, then give up too.
- The errors are the caller's: a layer above sets `error` and `timeout_error` (a subclass
  per layer, e.g. the checkpoint's), `purpose` and `timeout_key`, so its messages keep
  naming its own config; by default they are `AgreementError` and `AgreementTimeout`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from spmd.comm.errors import AgreementError, AgreementTimeout
from spmd.comm.kvstore import kv_client

Decide = Callable[[list[dict]], dict]


def all_ok(votes: list[dict]) -> dict:
    """The default decision: ok when every vote is; the failing ranks' errors otherwise."""
    errors = [v.get("error", f"rank {r} failed") for r, v in enumerate(votes) if not v.get("ok")]
    return {"ok": not errors, "errors": errors}


def ranks_text(ranks: list[int], limit: int = 16) -> str:
    """"1, 2, 5" for messages; past `limit` ranks, "... and N more"."""
    shown = ", ".join(str(r) for r in ranks[:limit])
    return shown + (f" and {len(ranks) - limit} more" if len(ranks) > limit else "")


class Coordinator:
    """Gather-decide-broadcast on one channel; every rank calls `agree` in the same order.

    A layer that wants its own errors and config key in the messages subclasses it and sets
    the class attributes below (see spmd.checkpoint.coordination).
    """

    error: type[Exception] = AgreementError
    timeout_error: type[Exception] = AgreementTimeout
    purpose = "agreement among ranks"  # "... needs jax.distributed to be initialized ..."
    timeout_key = "timeout_s"          # the config key that sets `timeout_s`
    namespace = "agree"                # keys live under spmd/<namespace>/<channel>/
    _calls: dict[tuple[str, int], int] = {}   # ("<namespace>/<channel>", rank) -> calls so far

    def __init__(self, rank: int, size: int, timeout_s: float, channel: str,
                 client: Any = None):
        self.rank, self.size, self.timeout_s, self.channel = rank, size, timeout_s, channel
        self._client = client

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = kv_client()
            if self._client is None:
                raise self.error(f"{self.purpose} needs jax.distributed to be initialized "
                                 "when there is more than one process")
        return self._client

    def agree(self, what: str, vote: dict, decide: Decide = all_ok) -> dict:
        """Rank 0 decides from every rank's `vote`; every rank returns that decision.

        `what` completes "waiting for rank(s) N to ..." in timeout messages.
        """
        channel = f"{self.namespace}/{self.channel}"
        key = (channel, self.rank)   # by rank too: tests play ranks as threads of one process
        seq = Coordinator._calls[key] = Coordinator._calls.get(key, 0) + 1
        if self.size == 1:
            return decide([vote])
        prefix = f"spmd/{channel}/{seq}"
        client = self.client
        try:
            client.key_value_set(f"{prefix}/vote/{self.rank}", json.dumps(vote))
        except Exception as e:  # the coordination service is gone (rank 0 died?)
            raise self.error(f"rank {self.rank}: cannot post its vote to {what} "
                             f"(jax.distributed key-value store: {e})") from None
        if self.rank == 0:
            return self._decide(prefix, what, decide)
        wait_s = self.timeout_s * 1.1 + 5.0  # rank 0 times out first and says whom it missed
        try:
            text = client.blocking_key_value_get(f"{prefix}/decision", int(wait_s * 1000))
        except Exception as e:
            raise self.timeout_error(
                f"rank {self.rank}: no decision from rank 0 within {wait_s:.0f} s while waiting "
                f"for all ranks to {what} (rank 0 gathers every rank's answer; it may have died "
                f"or hung - see its log for the ranks it waited for): {e}") from None
        decision = json.loads(text)
        if decision.get("timeout"):
            raise self.timeout_error(decision["error"])
        return decision

    def _decide(self, prefix: str, what: str, decide: Decide) -> dict:
        client = self.client
        deadline = time.monotonic() + self.timeout_s
        pause = 0.0005
        votes: dict[int, dict] = {}
        while True:
            for key, value in client.key_value_dir_get(f"{prefix}/vote/"):
                r = int(key.rsplit("/", 1)[-1])
                if r not in votes:
                    votes[r] = json.loads(value)
            if len(votes) == self.size:
                break
            if time.monotonic() > deadline:
                missing = [r for r in range(self.size) if r not in votes]
                decision = {"ok": False, "timeout": True, "missing": missing, "error": (
                    f"rank 0: timed out after {self.timeout_s:.0f} s waiting for rank(s) "
                    f"{ranks_text(missing)} to {what} ({self.timeout_key}); they may have "
                    f"died, hung, or be stuck writing - check their logs")}
                client.key_value_set(f"{prefix}/decision", json.dumps(decision))
                raise self.timeout_error(decision["error"])
            time.sleep(pause)
            pause = min(0.05, pause * 1.5)
        try:
            decision = decide([votes[r] for r in range(self.size)])
        except Exception as e:
            decision = {"ok": False, "errors": [f"rank 0: deciding how to {what} failed: {e!r}"]}
        client.key_value_set(f"{prefix}/decision", json.dumps(decision))
        try:
            client.key_value_delete(f"{prefix}/vote/")
        except Exception:
            pass
        return decision
