"""Rank 0's restore plan: the newest step every rank has a source for, and the typed votes
and decisions of the restore's agreements (spmd.checkpoint.restore drives them).

Each rank votes the committed local copies it has (`CopiesVote`: its own and the partner
copies it holds, in this run's layout or in a variant's, without some optional fields), rank
0 adds the persistent tier's steps, and `Planner.plan` picks the newest step for which every
rank has a source: own copy, else a partner's copy, else (for the whole job) the persistent
tier (`Plan`). After each read the ranks vote the sources that failed their check
(`SourcesVote` of `BadSource`); rank 0 strikes those off and plans again (`SourcesChecked`).
Votes and decisions are frozen dataclasses (spmd.comm.agreement: JSON only at its edge).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from spmd.comm.agreement import Decision, Vote


@dataclass(frozen=True)
class Plan:
    """What to restore: `tier` "local" (`servers`: which rank serves each rank's copy;
    `older`: the variant layout it was saved in, 0: this run's), "persistent", or None:
    nothing (`step` -1)."""

    tier: str | None = None
    step: int = -1
    servers: dict[int, int] = field(default_factory=dict)
    older: int = 0

    def as_event(self) -> dict[str, Any]:
        """The plan as events record it ({"tier": None} when there is nothing)."""
        if self.tier is None:
            return {"tier": None}
        if self.tier != "local":
            return {"tier": self.tier, "step": self.step}
        return {"tier": "local", "step": self.step, "servers": dict(self.servers),
                **({"older": self.older} if self.older else {})}


@dataclass(frozen=True, kw_only=True)
class CopiesVote(Vote):
    """The committed local copies a rank has: `own` steps, `held` (step, owner) partner
    copies, the same in a variant layout (`own_older` (step, variant), `held_older` (step,
    owner, variant)), the copies it skipped and why (`notes`); rank 0 adds the persistent
    tier's committed steps."""

    own: tuple[int, ...] = ()
    held: tuple[tuple[int, int], ...] = ()
    own_older: tuple[tuple[int, int], ...] = ()
    held_older: tuple[tuple[int, int, int], ...] = ()
    notes: tuple[str, ...] = ()
    persistent: tuple[int, ...] = ()


@dataclass(frozen=True)
class BadSource:
    """A source that failed its check: `kind` ("own", "held", "own_older<i>",
    "held_older<i>", "persistent"), the step, the rank whose copy it is (-1: persistent), and
    the message naming the file."""

    kind: str
    step: int
    owner: int
    message: str


@dataclass(frozen=True, kw_only=True)
class SourcesVote(Vote):
    """The sources of the planned step that failed this rank's check."""

    bad: tuple[BadSource, ...] = ()


@dataclass(frozen=True, kw_only=True)
class RestorePlan(Decision):
    """Rank 0's first plan."""

    plan: Plan


@dataclass(frozen=True, kw_only=True)
class SourcesChecked(Decision):
    """After a round of checks: ok, or (`ok` False) the `problems` found and the next plan."""

    problems: tuple[str, ...]
    plan: Plan | None


@dataclass
class Planner:
    """Rank 0's bookkeeping across planning rounds."""

    size: int
    votes: list[CopiesVote] = field(default_factory=list)
    bad: set[tuple[str, int, int]] = field(default_factory=set)
    problems: list[str] = field(default_factory=list)

    def first(self, votes: list[CopiesVote]) -> RestorePlan:
        """The first round: every rank's copies, and the plan from them."""
        self.votes = votes
        return RestorePlan(plan=self.plan())

    def plan(self) -> Plan:
        persistent = set(self.votes[0].persistent)
        steps = sorted({s for v in self.votes for s in v.own}
                       | {e[0] for v in self.votes for e in (*v.held, *v.own_older,
                                                             *v.held_older)}
                       | persistent, reverse=True)
        variants = max((e[-1] for v in self.votes for e in (*v.own_older, *v.held_older)),
                       default=0)
        for s in steps:
            for older in range(variants + 1):   # the current layout first, then the variants
                servers = self._servers(s, older)
                if servers is not None:
                    return Plan("local", s, servers, older)
            if s in persistent and ("persistent", s, -1) not in self.bad:
                return Plan("persistent", s)
        return Plan()

    def _servers(self, step: int, older: int) -> dict[int, int] | None:
        """Who serves each rank's copy of `step` (all in the current layout, older=0, or all
        in variant `older`), or None when some rank's copy is missing."""
        own_key, held_key = ("own_older", "held_older") if older else ("own", "held")
        held: dict[tuple[int, int], int] = {}
        for h, v in enumerate(self.votes):
            for entry in (v.held_older if older else v.held):
                if not older or entry[2] == older:
                    held.setdefault((entry[0], entry[1]), h)
        if older:
            own_key, held_key = f"own_older{older}", f"held_older{older}"
        servers = {}
        for q in range(self.size):
            mine = ([e[0] for e in self.votes[q].own_older if e[1] == older]
                    if older else self.votes[q].own)
            if step in mine and (own_key, step, q) not in self.bad:
                servers[q] = q
            elif (step, q) in held and (held_key, step, q) not in self.bad:
                servers[q] = held[(step, q)]
            else:
                return None
        return servers

    def decide_round(self, votes: list[SourcesVote]) -> SourcesChecked:
        """After a round of checks: ok, or strike off what failed and plan again."""
        reports = [b for v in votes for b in v.bad]
        if not reports:
            return SourcesChecked(problems=(), plan=None)
        for b in reports:
            self.bad.add((b.kind, b.step, b.owner))
            self.problems.append(b.message)
        return SourcesChecked(ok=False, problems=tuple(b.message for b in reports),
                              plan=self.plan())
