"""Restore planning: the newest step every rank can restore, from the nearest intact copy.

Every rank reports the committed local copies it has (its own, and those it holds for partner
ranks) whose layout matches this run; rank 0 adds the persistent steps and picks the newest
step for which every rank has a source: own copy, else the partner's copy, else (for the
whole job) the persistent tier. Every chosen source is checksum-verified before use; a bad
one is reported (naming the file), struck off, and rank 0 plans again. All ranks act on rank
0's plan, so they always agree on the step and the sources. The plan, and the typed votes
and decisions of these agreements, are spmd.checkpoint.restore_plan's.

A state may name `optional` fields: ones a checkpoint may have been written without (spmd's
`rng`, added to the state later; its `ema`, present only with train.ema_decay). A local copy
saved in the layout of the state without some of them (`RestoreContext.variants`: one layout
per subset of optional fields left out; `older` is the single variant without all of them),
or a persistent step whose items lack them, still restores; those fields come back as None
and `Restored.missing` names them, for the caller to fill.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import jax
import numpy as np

from spmd.checkpoint.interface import CheckpointError, Restored
from spmd.checkpoint.layout import PieceId, SaveLayout, assemble
from spmd.checkpoint.local import LocalCopy, LocalTier
from spmd.checkpoint.persistent import PersistentTier
from spmd.checkpoint.restore_plan import (
    BadSource,
    CopiesVote,
    Plan,
    Planner,
    RestorePlan,
    SourcesChecked,
    SourcesVote,
)
from spmd.checkpoint.state_items import without_fields
from spmd.checkpoint.transport import CollectSink, Incoming, Outgoing, Transport
from spmd.comm.agreement import Coordinator, Vote

log = logging.getLogger("spmd.checkpoint")

RESTORE_TAG = (1 << 22) - 8


@dataclass
class RestoreContext:
    rank: int
    size: int
    coord: Coordinator
    layout: SaveLayout
    local: LocalTier | None
    persistent: PersistentTier | None
    transport: Transport | None
    emit: Callable[..., None]
    buffers: dict[PieceId, np.ndarray] = field(default_factory=dict)  # reused, this rank's
    older: SaveLayout | None = None   # layout of the state without its optional fields
    # (fields left out, layout) per variant: subsets of the optional fields a local copy may
    # lack; empty: just `older`, lacking all of them
    variants: Sequence[tuple[tuple[str, ...], SaveLayout]] = ()


def _variants(ctx: RestoreContext, optional: Sequence[str]
              ) -> list[tuple[tuple[str, ...], SaveLayout]]:
    """Variant i + 1 of a plan's "older": what it leaves out and its layout."""
    if not optional:
        return []
    if ctx.variants:
        return list(ctx.variants)
    return [(tuple(optional), ctx.older)] if ctx.older is not None else []


def restore(ctx: RestoreContext, abstract_state: Any,
            optional: Sequence[str] = ()) -> Restored | None:
    """Collective: every rank calls it; all return the same step (or None).

    `optional`: top-level fields of the state that a checkpoint may lack (see the module
    docstring; local copies in `ctx.older`'s layout are considered only with it).

    `Restored.timings` splits this rank's time: plan_s, read_s, exchange_s, h2d_s (local
    tier) or orbax_s (persistent tier: the read and the put on the devices, in one call:
    spmd's reader or Orbax's; where the read checks the chunks: read_s = check_s, the
    manifest's check, + orbax_s).
    """
    t_start = time.perf_counter()
    timings = {"plan_s": 0.0, "read_s": 0.0}
    own: dict[int, LocalCopy] = {}
    held: dict[tuple[int, int], LocalCopy] = {}
    vote = CopiesVote()
    variants = _variants(ctx, optional)
    which = {lay.signature: i + 1 for i, (_, lay) in enumerate(variants)}
    if ctx.local is not None:
        signatures = [ctx.layout.signature] + list(which)
        own, held, notes = ctx.local.copies(signatures)
        if ctx.transport is None and ctx.size > 1:
            held = {}  # a partner copy cannot be fetched without MPI
        vote = CopiesVote(
            own=tuple(sorted(s for s, c in own.items() if c.signature not in which)),
            held=tuple(sorted(k for k, c in held.items() if c.signature not in which)),
            own_older=tuple(sorted((s, which[c.signature]) for s, c in own.items()
                                   if c.signature in which)),
            held_older=tuple(sorted((*k, which[c.signature]) for k, c in held.items()
                                    if c.signature in which)),
            notes=tuple(notes))
        for note in notes:
            log.info("local checkpoint skipped: %s", note)
    if ctx.rank == 0 and ctx.persistent is not None:
        vote = replace(vote, persistent=tuple(ctx.persistent.committed_steps(reload=True)))
    planner = Planner(ctx.size)
    plan = ctx.coord.agree("report the checkpoints they have", vote, planner.first,
                           RestorePlan).plan
    problems: list[str] = []
    loaded: tuple[Any, tuple[str, ...]] | None = None   # a persistent step read in the loop
    while plan.tier is not None:
        step = plan.step
        t0 = time.perf_counter()
        if plan.tier == "local":
            bad, data = _load_local(ctx, plan, own, held)
        elif ctx.size == 1:   # one read, which checks every chunk's crc32c
            bad, loaded = _load_persistent(ctx, step, abstract_state, optional, timings)
            data = None
        else:
            bad, loaded = _load_persistent_ranks(ctx, step, abstract_state, optional, timings)
            data = None
        timings["read_s"] += time.perf_counter() - t0
        decision = ctx.coord.agree(f"check their sources for step {step}",
                                   SourcesVote(bad=tuple(bad)), planner.decide_round,
                                   SourcesChecked)
        if decision.ok:
            break
        assert decision.plan is not None
        loaded = None   # another rank's source failed: this round's read is not used
        problems += decision.problems
        for p in decision.problems:
            mine = p.startswith(f"rank {ctx.rank}:")
            log.log(logging.WARNING if mine else logging.INFO, "restore: %s; falling back", p)
        if ctx.rank == 0:
            ctx.emit("restore_fallback", step=step, tier=plan.tier,
                     problems=list(decision.problems), next=decision.plan.as_event())
        plan = decision.plan
    if plan.tier is None:
        if problems:
            raise CheckpointError("no intact checkpoint left to restore; problems found: "
                                  + "; ".join(problems))
        return None
    step = plan.step
    missing: tuple[str, ...] = ()
    timings["plan_s"] = time.perf_counter() - t_start - timings["read_s"]
    if plan.tier == "local":
        target = abstract_state
        if plan.older:
            missing = variants[plan.older - 1][0]
            target = without_fields(abstract_state, missing)
        leaves = _exchange_and_assemble(ctx, plan, data, jax.tree.leaves(target), timings)
        state = jax.tree.unflatten(jax.tree.structure(target), leaves)
        servers = plan.servers
        source = "local" if servers[ctx.rank] == ctx.rank else "partner"
        partners = {q: h for q, h in servers.items() if q != h}
        detail = f"step {step} from the local tier" + (
            "; partner copies for " + ", ".join(f"rank {q} (held by rank {h})"
                                                for q, h in sorted(partners.items()))
            if partners else "")
    else:
        assert ctx.persistent is not None
        if loaded is not None:   # orbax_s: the read, during which check_s ran
            (state, missing) = loaded
        else:
            t0 = time.perf_counter()
            state, missing = _read_persistent(ctx, step, abstract_state, optional)
            timings["orbax_s"] = time.perf_counter() - t0
        source, detail = "persistent", f"step {step} from {ctx.persistent.step_dir(step)}"
    if problems:
        detail += "; fell back after: " + "; ".join(problems)
    timings["total_s"] = time.perf_counter() - t_start
    return Restored(step=step, state=state, source=source, detail=detail, timings=timings,
                    missing=missing)


def _load_local(ctx: RestoreContext, plan: Plan, own: dict[int, LocalCopy],
                held: dict[tuple[int, int], LocalCopy]) -> tuple[list[BadSource], dict]:
    """Load and verify every copy this rank serves; report the bad ones."""
    assert ctx.local is not None
    step, servers = plan.step, plan.servers
    layout = _plan_layout(ctx, plan)
    suffix = f"_older{plan.older}" if plan.older else ""
    bad: list[BadSource] = []
    data = {}
    for q, h in servers.items():
        if h != ctx.rank:
            continue
        kind, copy = ("own", own.get(step)) if q == ctx.rank else ("held", held.get((step, q)))
        kind += suffix
        try:
            if copy is None:
                raise CheckpointError(f"rank {ctx.rank} has no committed copy of rank {q}")
            pieces = ctx.local.load(copy, layout, ctx.buffers if q == ctx.rank else None)
            expected = {(p.leaf, p.key) for p in layout.writes(q)}
            missing = expected - set(pieces)
            if missing:
                raise CheckpointError(f"{copy.index}: {len(missing)} expected pieces missing")
            data[q] = pieces
        except Exception as e:
            what = "own copy" if q == ctx.rank else f"partner copy of rank {q}"
            bad.append(BadSource(kind, step, q, f"rank {ctx.rank}: step {step} {what}: {e}"))
    return bad, data


def _plan_layout(ctx: RestoreContext, plan: Plan) -> SaveLayout:
    """The layout the planned local step was saved in."""
    if plan.older:
        if ctx.variants:
            return ctx.variants[plan.older - 1][1]
        assert ctx.older is not None
        return ctx.older
    return ctx.layout


def _check_persistent(ctx: RestoreContext, step: int, deep: bool = True) -> list[BadSource]:
    """This rank's share of the manifest check of a persistent step, as "bad" reports."""
    assert ctx.persistent is not None
    try:
        problems = ctx.persistent.verify(step, deep)
    except Exception as e:
        problems = [f"{ctx.persistent.step_dir(step)}: {e}"]
    return [BadSource("persistent", step, -1, f"rank {ctx.rank}: persistent step {step}: {p}")
            for p in problems]


def _read_persistent(ctx: RestoreContext, step: int, abstract_state: Any,
                     optional: Sequence[str]) -> tuple[Any, tuple[str, ...]]:
    """Orbax's restore of `step` onto `abstract_state` (on the devices); a failure names the
    step and suggests the usual cause."""
    assert ctx.persistent is not None
    try:
        state, missing = ctx.persistent.restore(step, abstract_state, optional)
        return jax.block_until_ready(state), missing
    except Exception as e:
        raise CheckpointError(
            f"rank {ctx.rank}: restoring {ctx.persistent.step_dir(step)} onto this run's "
            f"state failed (was it saved by a different model or config?): "
            f"{type(e).__name__}: {str(e)[:2000]}") from e


def _load_persistent(ctx: RestoreContext, step: int, abstract_state: Any,
                     optional: Sequence[str], timings: dict | None = None
                     ) -> tuple[list[BadSource], tuple[Any, tuple[str, ...]] | None]:
    """One process: check the small files and the data files' sizes while the step is read
    (spmd's reader, each chunk's crc32c checked in hardware as it is read, for steps it
    understands; Orbax's, whose TensorStore checks them, otherwise): no separate pass over
    the data, and the read is used only once the check passed too. A read that fails is told
    apart from damage by the full check (each data file's chunks), which names the damaged
    file; a step that passes it failed for another reason (another model or config): that
    error is raised, as before.

    Several processes: `_load_persistent_ranks`."""
    assert ctx.persistent is not None
    bad, loaded, failed = _checked_read(
        ctx, step, lambda: _read_persistent(ctx, step, abstract_state, optional), timings)
    if bad or loaded is not None:
        return bad, None if bad else loaded
    bad = _check_persistent(ctx, step, deep=True)
    if not bad:
        raise failed
    return bad, None


def _checked_read(ctx: RestoreContext, step: int, read: Callable[[], Any],
                  timings: dict | None) -> tuple[list[BadSource], Any, Exception | None]:
    """(problems the manifest's shallow check found, what `read` returned or None, the
    exception it raised or None): the check (small files' crc32c, data files' sizes, on
    another thread) runs while `read` reads, both cold, mostly waiting for the disk."""
    assert ctx.persistent is not None
    t0 = time.perf_counter()
    ctx.persistent.prefetch(step)   # the disk starts reading ahead of the read's requests
    took: list[float] = []

    def check() -> list[BadSource]:
        t = time.perf_counter()
        try:
            return _check_persistent(ctx, step, deep=False)
        finally:
            took.append(time.perf_counter() - t)

    with ThreadPoolExecutor(1, thread_name_prefix="spmd-ckpt-check") as pool:
        checking = pool.submit(check)
        loaded, failed = None, None
        try:
            loaded = read()
        except Exception as e:
            failed = e
        read_s = time.perf_counter() - t0
        bad = checking.result()
    if timings is not None:   # check_s overlaps orbax_s (the read); read_s is both
        timings["check_s"] = timings.get("check_s", 0.0) + sum(took)
        timings["orbax_s"] = read_s
    if failed is not None and not isinstance(failed, CheckpointError):
        raise failed
    return bad, loaded, failed


def _load_persistent_ranks(ctx: RestoreContext, step: int, abstract_state: Any,
                           optional: Sequence[str], timings: dict
                           ) -> tuple[list[BadSource], tuple[Any, tuple[str, ...]] | None]:
    """Several processes: when every rank's spmd reader understands the step (agreed first),
    each rank checks its share of the small files while it reads what its devices need,
    every chunk's crc32c checked as it is read: the data is read once, and a rank whose read
    fails reports it (naming the file) in the round's agreement, as the reader has no barrier
    to leave the others in. Otherwise the full check of each rank's share of the data files,
    then Orbax's read once all ranks found the step intact (its barriers need every rank)."""
    assert ctx.persistent is not None
    readable = ctx.persistent.readable(step, abstract_state, optional)
    agreed = ctx.coord.agree(f"tell whether spmd's reader reads persistent step {step}",
                             Vote(ok=readable))
    if not agreed.ok:
        log.info("persistent step %d: not every rank's spmd reader reads it (an older or "
                 "compressed step?): full check, then Orbax's read", step)
        return _check_persistent(ctx, step), None

    def read() -> tuple[Any, tuple[str, ...]]:
        try:
            state, missing = ctx.persistent.restore(step, abstract_state, optional,
                                                    orbax=False)
            return jax.block_until_ready(state), missing
        except Exception as e:   # reported in the agreement, never raised alone
            raise CheckpointError(f"rank {ctx.rank}: persistent step {step}: "
                                  f"{type(e).__name__}: {str(e)[:2000]}") from e

    bad, loaded, failed = _checked_read(ctx, step, read, timings)
    if bad or loaded is not None:
        return bad, None if bad else loaded
    return [BadSource("persistent", step, -1, str(failed))], None


def _exchange_and_assemble(ctx: RestoreContext, plan: Plan, data: dict[int, dict],
                           abstract_leaves: list, timings: dict) -> list[jax.Array]:
    """Send every rank the pieces it needs from the copies this rank serves; build arrays."""
    layout, me, servers = _plan_layout(ctx, plan), ctx.rank, plan.servers
    mine: dict[PieceId, np.ndarray] = {}
    wanted: dict[int, list[PieceId]] = {}  # server -> pieces I receive from it
    for pid in layout.needs(me):
        w = layout.source_of(pid, me)
        h = servers[w]
        if h == me:
            mine[pid] = data[w][pid]
        else:
            wanted.setdefault(h, []).append(pid)
    sends = []
    for r in range(ctx.size):
        if r == me:
            continue
        out = [data[layout.source_of(pid, r)][pid] for pid in layout.needs(r)
               if servers[layout.source_of(pid, r)] == me]
        if out:
            sends.append(Outgoing(r, {"sizes": [a.nbytes for a in out]},
                                  [np.ascontiguousarray(a).reshape(-1).view(np.uint8)
                                   for a in out]))
    recvs, targets = [], {}
    for h, pids in wanted.items():
        arrays = [np.empty(layout.piece(pid).shape, _dtype(layout, pid)) for pid in pids]
        targets[h] = (pids, arrays)
        recvs.append(Incoming(h, CollectSink(arrays)))
    t0 = time.perf_counter()
    if sends or recvs:
        if ctx.transport is None:
            raise CheckpointError(f"rank {me}: restoring step {plan.step} needs pieces from "
                                  "other ranks but MPI is not available")
        ctx.transport.exchange(sends, recvs, RESTORE_TAG,
                               f"moving restored pieces of step {plan.step}")
    for pids, arrays in targets.values():
        mine.update(zip(pids, arrays))
    timings["exchange_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = jax.block_until_ready(assemble(abstract_leaves, mine))
    timings["h2d_s"] = time.perf_counter() - t0
    return out


def _dtype(layout: SaveLayout, pid: PieceId) -> np.dtype:
    from spmd.checkpoint.layout import np_dtype

    return np_dtype(layout.dtypes[pid[0]])
