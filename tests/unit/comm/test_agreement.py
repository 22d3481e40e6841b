"""spmd.comm.agreement: typed votes and decisions, JSON only at the edge, ranks as threads."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from spmd.checkpoint.coordination import (
    CheckpointCoordinator,
    CheckpointTimeout,
    LocalCommit,
    LocalVote,
    NewerSteps,
    decide_local,
)
from spmd.checkpoint.interface import CheckpointError
from spmd.checkpoint.restore_plan import (
    BadSource,
    CopiesVote,
    Plan,
    RestorePlan,
    SourcesChecked,
    SourcesVote,
)
from spmd.comm.agreement import Coordinator, Decision, Vote, all_ok, from_json, to_json
from tests.unit.comm.test_comm import FakeStore, on_ranks


@dataclass(frozen=True, kw_only=True)
class Chosen(Decision):
    """A site's decision with required fields: it cannot be built from ok and errors."""

    step: int
    ranks: tuple[int, ...]


def test_a_vote_and_a_site_decision_survive_the_json_edge_typed():
    vote = CopiesVote(own=(5, 10), held=((5, 1),), own_older=((4, 1),),
                      held_older=((3, 1, 2),), notes=("skipped",), persistent=(10,))
    back = from_json(CopiesVote, to_json(vote))
    assert back == vote and type(back) is CopiesVote
    assert type(back.own) is tuple and type(back.held[0]) is tuple
    assert type(back.held_older[0]) is tuple and back.held_older[0] == (3, 1, 2)

    bad = SourcesVote(bad=(BadSource("held", 10, 1, "rank 0: bad partner copy"),))
    back_bad = from_json(SourcesVote, to_json(bad))
    assert back_bad == bad and isinstance(back_bad.bad[0], BadSource)

    decision = SourcesChecked(ok=False, problems=("rank 0: bad file",),
                              plan=Plan("local", 5, {0: 0, 1: 1}, older=2))
    back_decision = from_json(SourcesChecked, to_json(decision))
    assert back_decision == decision and isinstance(back_decision.plan, Plan)
    assert type(back_decision.problems) is tuple
    assert list(back_decision.plan.servers) == [0, 1]   # int keys again, not JSON's strings
    assert from_json(SourcesChecked, to_json(SourcesChecked(problems=(), plan=None))).plan is None

    local = LocalVote(bytes=3, files={"index.json": "0000abcd"}, seconds=1, newest=None)
    assert from_json(LocalVote, to_json(local)) == local
    assert type(from_json(LocalVote, to_json(local)).seconds) is float


def test_decide_gets_typed_votes_and_every_rank_the_same_typed_decision():
    store = FakeStore(2)
    seen: list = []

    def decide(votes: list[CopiesVote]) -> RestorePlan:
        seen.extend(votes)
        return RestorePlan(plan=Plan("local", 10, {0: 0, 1: 0}))

    def rank(r: int) -> RestorePlan:
        coord = CheckpointCoordinator(r, 2, 10.0, "typed-test", client=store)
        vote = CopiesVote(own=(10,), held=((10, 1),) if r == 0 else ())
        return coord.agree("report the checkpoints they have", vote, decide, RestorePlan)

    zero, one = on_ranks(rank)
    assert zero == one == RestorePlan(plan=Plan("local", 10, {0: 0, 1: 0}))
    assert isinstance(one, RestorePlan) and isinstance(one.plan, Plan)
    assert [type(v) for v in seen] == [CopiesVote, CopiesVote]
    assert seen[0].held == ((10, 1),) and seen[1].held == ()


def test_a_timeout_is_raised_by_every_rank_whatever_the_site_type_requires():
    store = FakeStore(3)

    def rank(r: int) -> Chosen:
        coord = CheckpointCoordinator(r, 3, 0.3, "timeout-test", client=store)
        return coord.agree("pick a step", Vote(),
                           lambda votes: Chosen(step=1, ranks=(0, 1, 2)), Chosen)

    zero, one = on_ranks(rank, 2)     # rank 2 never votes
    for e in (zero, one):
        assert isinstance(e, CheckpointTimeout), e
        assert "rank 0: timed out after 0 s waiting for rank(s) 2 to pick a step" in str(e)
        assert "(checkpoint.timeout_s)" in str(e)
    posted = from_json(Decision, next(v for k, v in store.data.items()
                                      if k.endswith("/decision")))
    assert posted.timeout and posted.missing == (2,) and not posted.ok


def test_a_failed_decide_is_a_failed_decision_or_an_error_on_every_rank():
    store = FakeStore(2)

    def broken(votes: list) -> Decision:
        raise ValueError("no disk")

    def rank(r: int) -> tuple:
        coord = CheckpointCoordinator(r, 2, 10.0, "failed-decide-test", client=store)
        local = coord.agree("commit step 1", LocalVote(), broken, LocalCommit)
        try:
            coord.agree("agree on persistent steps to discard", Vote(), broken, NewerSteps)
        except CheckpointError as e:
            return local, e
        return local, None

    for local, error in on_ranks(rank):
        assert isinstance(local, LocalCommit) and not local.ok
        assert local.errors == ("rank 0: deciding how to commit step 1 failed: "
                                "ValueError('no disk')",)
        assert type(error) is CheckpointError
        assert "deciding how to agree on persistent steps to discard failed" in str(error)


def test_one_process_decides_alone_with_the_same_types():
    coord = Coordinator(0, 1, 1.0, "alone-test")
    assert coord.agree("agree", Vote(ok=False, error="rank 0: full")) == Decision(
        ok=False, errors=("rank 0: full",))
    assert all_ok([Vote(), Vote(ok=False)]).errors == ("rank 1 failed",)
    votes = [LocalVote(bytes=2, seconds=1.0, newest=3), LocalVote(bytes=5, seconds=2.0)]
    assert decide_local(votes) == LocalCommit(bytes=7, safe=None, seconds=2.0)
    with pytest.raises(CheckpointError, match="deciding how to pick failed"):
        CheckpointCoordinator(0, 1, 1.0, "alone-test").agree(
            "pick", Vote(), lambda votes: 1 / 0, Chosen)
