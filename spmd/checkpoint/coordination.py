"""The checkpoint's agreement among ranks: spmd.comm's Coordinator with checkpoint errors.

Every decision of a save or a restore that all ranks must share goes through a
`CheckpointCoordinator` (channels "main", "local", "persistent"): it raises
`CheckpointError`, `CheckpointTimeout` when a rank waited longer than
`checkpoint.timeout_s`, and its messages name that key. The key-value store keys stay under
`spmd/ckpt/<channel>/`.

The checkpointer's own votes and decisions live here too, as frozen dataclasses (subclasses
of spmd.comm's `Vote` and `Decision`, JSON only at the agreement's edge): the local tier's
commit (`LocalVote`, `LocalCommit`, decided by `decide_local`), the newest committed step
(`StepsVote`, `NewestStep`), the checkpoint that `restore_params` reads (`ParamsVote`), and
the persistent steps a restore discards (`NewerSteps`). The restore plan's are in
spmd.checkpoint.restore_plan, the persistent commit's in spmd.checkpoint.step_manifest. A
decision with required fields makes a failed `decide` raise on every rank (see
spmd.comm.agreement); the local commit's has none, so its failure is a failed save.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from spmd.checkpoint.interface import CheckpointError
from spmd.comm.agreement import Coordinator, Decision, Vote, failed_votes
from spmd.comm.errors import AgreementTimeout


class CheckpointTimeout(CheckpointError, AgreementTimeout):
    """A rank waited longer than checkpoint.timeout_s for others."""


class CheckpointCoordinator(Coordinator):
    """Gather-decide-broadcast for checkpoint decisions (see spmd.comm.agreement)."""

    error = CheckpointError
    timeout_error = CheckpointTimeout
    purpose = "checkpoint agreement"
    timeout_key = "checkpoint.timeout_s"
    namespace = "ckpt"


@dataclass(frozen=True, kw_only=True)
class LocalVote(Vote):
    """A rank's local-tier write of a step (`LocalTier.write`): its bytes, its files' crc32
    (for the COMMITTED marker), its seconds, and its newest committed step below (None:
    none), or `ok` False and why."""

    bytes: int = 0
    files: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    newest: int | None = None


@dataclass(frozen=True, kw_only=True)
class LocalCommit(Decision):
    """Commit the local step: the bytes of all ranks, the slowest rank's seconds, and the
    newest step every rank has committed (`safe`, retention's floor; None: some rank has
    none)."""

    bytes: int = 0
    safe: int | None = None
    seconds: float = 0.0


def decide_local(votes: list[LocalVote]) -> LocalCommit:
    """Rank 0: commit when every rank wrote its share; the failing ranks' errors otherwise."""
    errors = failed_votes(votes)
    if errors:
        return LocalCommit(ok=False, errors=errors)
    newest = [v.newest for v in votes]
    return LocalCommit(bytes=sum(v.bytes for v in votes),
                       safe=None if any(n is None for n in newest) else min(newest),
                       seconds=max(v.seconds for v in votes))


@dataclass(frozen=True, kw_only=True)
class StepsVote(Vote):
    """The committed steps a rank sees (rank 0 adds the persistent tier's)."""

    steps: tuple[int, ...] = ()


@dataclass(frozen=True, kw_only=True)
class NewestStep(Decision):
    """The newest committed step any rank sees (None: no checkpoint)."""

    newest: int | None


@dataclass(frozen=True, kw_only=True)
class ParamsVote(Vote):
    """For `restore_params`: the local steps this rank can read; rank 0 adds the persistent
    tier's committed steps."""

    local: tuple[int, ...] = ()
    persistent: tuple[int, ...] = ()


@dataclass(frozen=True, kw_only=True)
class NewerSteps(Decision):
    """Persistent steps newer than the restored one: never committed (`steps`, discarded)
    and committed but not used (`kept`, damaged: named and kept for inspection)."""

    steps: tuple[int, ...]
    kept: tuple[int, ...]
