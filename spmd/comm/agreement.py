"""Agreement among ranks with a timeout that names who was waited for.

Every rank posts a small vote to the jax.distributed key-value store (the service every
multi-process JAX job already runs); rank 0 polls for all votes, decides, and posts the
decision, which every other rank reads. Rank 0 knows exactly which ranks are missing when it
gives up, and says so in the decision that the others then raise. No MPI is needed, so this
works under every launcher, from any thread, and the store never blocks forever.

Votes and decisions are frozen dataclasses: a `Vote` (ok, error) and a `Decision` (ok,
errors, and the timeout's fields), or a site's subclass of either with its own named, typed
fields (spmd.checkpoint's, next to the code that uses them). JSON exists only at the edge,
inside `Coordinator.agree`: a vote or a decision goes out as its `dataclasses.asdict` and
comes back as its type (`from_json`: tuples from lists, nested dataclasses, int dict keys).

Invariants
- Every rank calls `agree` on a channel in the same order; the n-th call of every rank
  meets the others' n-th (keys `spmd/<namespace>/<channel>/<n>/...`). n counts per process,
  not per object: a second coordinator on a channel (a second checkpointer in one job, e.g.
  restoring two runs) goes on from the first one's count, so it never meets old keys.
- Every rank of one call votes with the same type (a subclass of `Vote`), and all pass the
  same `decision_type` (a subclass of `Decision`): `decide` gets the votes typed, in rank
  order, and returns that type.
- No wait is unbounded: rank 0 gives up after `timeout_s` and names the missing ranks and
  `timeout_key`; the others wait a little longer for rank 0's word, then give up too. Rank 0
  posts a plain `Decision` with `timeout` set, which every rank reads (and raises) before it
  builds the site's type, so a timeout is raised whatever fields that type requires.
- A `decide` that raises becomes a decision with `ok` False naming the failure in `errors`
  (every rank returns it); where the site's type cannot be built from ok and errors alone
  (a required field), every rank raises `error` with that message instead.
- The errors are the caller's: a layer above sets `error` and `timeout_error` (a subclass
  per layer, e.g. the checkpoint's), `purpose` and `timeout_key`, so its messages keep
  naming its own config; by default they are `AgreementError` and `AgreementTimeout`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from spmd.comm.errors import AgreementError, AgreementTimeout
from spmd.comm.kvstore import kv_client


@dataclass(frozen=True, kw_only=True)
class Vote:
    """One rank's vote: ok, or why not (`error`, a message naming the rank)."""

    ok: bool = True
    error: str | None = None


@dataclass(frozen=True, kw_only=True)
class Decision:
    """Rank 0's decision: ok, or the failing ranks' `errors`. A timeout (`timeout`, the
    `missing` ranks, rank 0's message in `error`) is raised by `agree`, never returned."""

    ok: bool = True
    errors: tuple[str, ...] = ()
    timeout: bool = False
    missing: tuple[int, ...] = ()
    error: str | None = None


V = TypeVar("V", bound=Vote)
D = TypeVar("D", bound=Decision)
T = TypeVar("T")


def failed_votes(votes: list[Vote]) -> tuple[str, ...]:
    """The error of each rank whose vote is not ok, in rank order ("rank N failed" where
    it gave none)."""
    return tuple(v.error if v.error is not None else f"rank {r} failed"
                 for r, v in enumerate(votes) if not v.ok)


def all_ok(votes: list[Vote]) -> Decision:
    """The default decision: ok when every vote is; the failing ranks' errors otherwise."""
    errors = failed_votes(votes)
    return Decision(ok=not errors, errors=errors)


def ranks_text(ranks: list[int], limit: int = 16) -> str:
    """"1, 2, 5" for messages; past `limit` ranks, "... and N more"."""
    shown = ", ".join(str(r) for r in ranks[:limit])
    return shown + (f" and {len(ranks) - limit} more" if len(ranks) > limit else "")


# ------------------------------------------------------------------ the JSON edge

def to_json(obj: Any) -> str:
    """A vote or a decision (any dataclass) as the JSON text that travels."""
    return json.dumps(dataclasses.asdict(obj))


def from_json(cls: type[T], text: str) -> T:
    """The dataclass `cls` back from `to_json`'s text (see `from_wire`)."""
    return from_wire(cls, json.loads(text))


def from_wire(cls: type[T], data: dict) -> T:
    """`cls` from its `asdict` form after a JSON round trip: each field rebuilt to its
    annotation (tuples, lists, dicts with int keys, nested dataclasses, `X | None`); keys
    that are not fields of `cls` are ignored, missing ones take their defaults."""
    hints = _fields(cls)
    return cls(**{name: _build(hints[name], value)
                  for name, value in data.items() if name in hints})


@functools.cache
def _fields(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def _build(tp: Any, value: Any) -> Any:
    if value is None or tp is Any:
        return value
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union or origin is types.UnionType:
        kinds = [a for a in args if a is not type(None)]
        return _build(kinds[0], value) if len(kinds) == 1 else value
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return from_wire(tp, value)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_build(args[0], v) for v in value)
        return tuple(_build(a, v) for a, v in zip(args, value)) if args else tuple(value)
    if origin is list:
        return [_build(args[0], v) for v in value] if args else list(value)
    if origin is dict:
        if not args:
            return dict(value)
        return {_build(args[0], k): _build(args[1], v) for k, v in value.items()}
    if tp is int and isinstance(value, str):   # a JSON object's key
        return int(value)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


# ------------------------------------------------------------------ the coordinator

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

    def agree(self, what: str, vote: V, decide: Callable[[list[V]], D] = all_ok,
              decision_type: type[D] = Decision) -> D:
        """Rank 0 decides from every rank's `vote`; every rank returns that decision.

        `decide` gets every rank's vote as `type(vote)`, in rank order, and returns a
        `decision_type`, which the other ranks rebuild from rank 0's post.
        `what` completes "waiting for rank(s) N to ..." in timeout messages.
        """
        channel = f"{self.namespace}/{self.channel}"
        key = (channel, self.rank)   # by rank too: tests play ranks as threads of one process
        seq = Coordinator._calls[key] = Coordinator._calls.get(key, 0) + 1
        if self.size == 1:
            return self._typed(self._decided([vote], what, decide, decision_type),
                               decision_type)
        prefix = f"spmd/{channel}/{seq}"
        client = self.client
        try:
            client.key_value_set(f"{prefix}/vote/{self.rank}", to_json(vote))
        except Exception as e:  # the coordination service is gone (rank 0 died?)
            raise self.error(f"rank {self.rank}: cannot post its vote to {what} "
                             f"(jax.distributed key-value store: {e})") from None
        if self.rank == 0:
            return self._decide(prefix, what, type(vote), decide, decision_type)
        wait_s = self.timeout_s * 1.1 + 5.0  # rank 0 times out first and says whom it missed
        try:
            text = client.blocking_key_value_get(f"{prefix}/decision", int(wait_s * 1000))
        except Exception as e:
            raise self.timeout_error(
                f"rank {self.rank}: no decision from rank 0 within {wait_s:.0f} s while waiting "
                f"for all ranks to {what} (rank 0 gathers every rank's answer; it may have died "
                f"or hung - see its log for the ranks it waited for): {e}") from None
        return self._read(json.loads(text), what, decision_type)

    def _read(self, data: dict, what: str, decision_type: type[D]) -> D:
        """Rank 0's posted decision as `decision_type`; a timeout (a plain `Decision`,
        whatever the site's type) is raised first."""
        plain = from_wire(Decision, data)
        if plain.timeout:
            raise self.timeout_error(plain.error)
        try:
            return from_wire(decision_type, data)
        except TypeError as e:   # a failed decide that the site's type cannot hold
            raise self.error("; ".join(plain.errors) or
                             f"rank {self.rank}: cannot read rank 0's decision to {what}: "
                             f"{e}") from None

    def _decided(self, votes: list[V], what: str, decide: Callable[[list[V]], D],
                 decision_type: type[D]) -> D | Decision:
        """`decide(votes)`; one that raises, a decision that is not ok and says so (a plain
        `Decision` where `decision_type` has required fields)."""
        try:
            return decide(votes)
        except Exception as e:
            errors = (f"rank 0: deciding how to {what} failed: {e!r}",)
            try:
                return decision_type(ok=False, errors=errors)
            except TypeError:   # the site's type requires more: every rank raises `error`
                return Decision(ok=False, errors=errors)

    def _decide(self, prefix: str, what: str, vote_type: type[V],
                decide: Callable[[list[V]], D], decision_type: type[D]) -> D:
        client = self.client
        deadline = time.monotonic() + self.timeout_s
        pause = 0.0005
        votes: dict[int, V] = {}
        while True:
            for key, value in client.key_value_dir_get(f"{prefix}/vote/"):
                r = int(key.rsplit("/", 1)[-1])
                if r not in votes:
                    votes[r] = from_json(vote_type, value)
            if len(votes) == self.size:
                break
            if time.monotonic() > deadline:
                missing = tuple(r for r in range(self.size) if r not in votes)
                timeout = Decision(ok=False, timeout=True, missing=missing, error=(
                    f"rank 0: timed out after {self.timeout_s:.0f} s waiting for rank(s) "
                    f"{ranks_text(list(missing))} to {what} ({self.timeout_key}); they may "
                    f"have died, hung, or be stuck writing - check their logs"))
                client.key_value_set(f"{prefix}/decision", to_json(timeout))
                raise self.timeout_error(timeout.error)
            time.sleep(pause)
            pause = min(0.05, pause * 1.5)
        decision = self._decided([votes[r] for r in range(self.size)], what, decide,
                                 decision_type)
        client.key_value_set(f"{prefix}/decision", to_json(decision))
        try:
            client.key_value_delete(f"{prefix}/vote/")
        except Exception:
            pass
        return self._typed(decision, decision_type)

    def _typed(self, decision: D | Decision, decision_type: type[D]) -> D:
        """The decision as the site's type; a failed decide it cannot hold, raised."""
        if not isinstance(decision, decision_type):
            raise self.error("; ".join(decision.errors) or f"rank 0 decided a "
                             f"{type(decision).__name__}, not a {decision_type.__name__}")
        return decision
