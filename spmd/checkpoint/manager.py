"""The hierarchical checkpointer the trainer talks to: when to save, async workers, honesty.

`maybe_save` blocks only for one snapshot of the state per step (`snapshot.py`: a
device-to-host copy into reused host buffers, a transfer into pinned host memory, or an
on-device copy), shared by both tiers when both save the same step. The host copy of a
device snapshot, the writes, partner exchange, Orbax's save, agreement and commit run in one
background thread per tier. A save that fails anywhere is raised on every rank at the next
`maybe_save`/`check`/`close`, naming rank and path; the failed step is never committed, so
the previous one stays the latest. `close()` emits `checkpoint_summary`: the fraction of wall
time (creation to close) training spent blocked on, or waiting for, checkpoints.

Invariants
- Every decision that makes a rank skip or fail a save is agreed (spmd.comm.agreement), so
  every rank takes the same path: the local tier's commit, the persistent tier's "can rank 0
  create the step's directory" (before Orbax's save, whose barrier would otherwise hold the
  other ranks), and its commit. Votes and decisions are typed (frozen dataclasses:
  spmd.checkpoint.coordination's, restore_plan's, step_manifest's).
- `checkpoint.local_failure: continue` (default): a local-tier save that every rank agreed
  failed (a full or broken node-local disk) is logged as a WARNING naming rank and path,
  recorded as `save_failed`, and training goes on (the persistent tier still saves); `stop`
  raises it like any other failed save. Timeouts always raise.
- When a save starts, whether the parameters are finite is computed once (a collective:
  spmd.checkpoint.finite) and recorded with the step in both tiers, for retention.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax

from spmd.checkpoint.coordination import (
    CheckpointCoordinator,
    CheckpointTimeout,
    LocalCommit,
    NewerSteps,
    NewestStep,
    ParamsVote,
    StepsVote,
    decide_local,
)
from spmd.checkpoint.finite import params_finite
from spmd.checkpoint.interface import CheckpointError, Restored
from spmd.checkpoint.layout import SaveLayout
from spmd.checkpoint.listing import scan_local
from spmd.checkpoint.local import LocalTier, partner_map
from spmd.checkpoint.params_reader import ParamsCheckpoint, find_checkpoints, read_params
from spmd.checkpoint.persistent import MANIFEST, PersistentTier, persistent_error
from spmd.checkpoint.policy import CheckpointConfig, SavePolicy, tier_dirs
from spmd.checkpoint.restore import RestoreContext
from spmd.checkpoint.restore import restore as plan_restore
from spmd.checkpoint.restore_plan import Plan, RestorePlan
from spmd.checkpoint.snapshot import Snapshot, Snapshotter
from spmd.checkpoint.state_items import PARAMS, split_state, without_fields
from spmd.checkpoint.transport import Transport
from spmd.comm.agreement import Vote

if TYPE_CHECKING:
    from mpi4py import MPI

    from spmd.launch import LaunchEnv
    from spmd.rundir.metrics import EventLog

log = logging.getLogger("spmd.checkpoint")


class _Worker:
    """One daemon thread running one job at a time; a job's exception is kept for `result`."""

    def __init__(self, name: str):
        self.name = name
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.step: int | None = None

    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, step: int, job: Callable[[], None]) -> None:
        assert not self.busy()

        def run() -> None:
            try:
                job()
            except BaseException as e:  # noqa: BLE001 - surfaced by result()
                self._error = e

        self.step, self._error = step, None
        self._thread = threading.Thread(target=run, name=f"spmd-ckpt-{self.name}", daemon=True)
        self._thread.start()

    def wait(self, timeout_s: float, rank: int) -> None:
        """Wait for the job in flight; raise its error (once)."""
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise CheckpointTimeout(
                    f"rank {rank}: the {self.name} save of step {self.step} did not finish "
                    f"within {timeout_s:.0f} s (checkpoint.timeout_s)")
            self._thread = None
        self.raise_error()

    def raise_error(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        err, self._error = self._error, None
        if err is not None:
            raise err


@dataclass
class _Tier:
    """One tier as the manager drives it: its store (None: the tier is off), when a save is
    due (`is_due(step, force, finished)`), the job that saves a snapshot (`job(step,
    snapshot, timing, finite)`, run by its worker: one save in flight at a time), the last
    step handed to it, and how many saves it ran. `name` is the `tier` of its events."""

    name: str
    store: LocalTier | PersistentTier | None
    is_due: Callable[[int, bool, bool], bool]
    job: Callable[[int, Snapshot, dict, bool | None], Callable[[], None]]
    worker: _Worker = field(init=False)
    last: int | None = None
    saves: int = 0

    def __post_init__(self) -> None:
        self.worker = _Worker(self.name)


def partner_holders(ck: CheckpointConfig, node_of_rank: Sequence[int],
                    transport: Transport | None) -> tuple[dict[int, int], str]:
    """Which rank holds each rank's partner copy of the local tier (empty: none), and, when
    none, why, in words for the log."""
    if ck.every <= 0:
        return {}, "the local tier is off"
    if ck.partner is False or (ck.partner is None and len(set(node_of_rank)) < 2):
        return {}, "checkpoint.partner is off"
    holders = partner_map(node_of_rank)
    if not holders:
        return {}, "there is only one node (checkpoint.partner needs two)"
    if transport is None:
        return {}, "MPI is not available (partner copies travel over MPI point-to-point)"
    return holders, ""


def optional_subsets(state: Any, optional: Sequence[str]) -> list[tuple[str, ...]]:
    """Non-empty subsets of the `optional` fields `state` has (not None), fewest first: the
    fields a local copy may have been saved without."""
    present = [n for n in optional if _field(state, n) is not None]
    return [c for r in range(1, len(present) + 1)
            for c in itertools.combinations(present, r)]


def _field(state: Any, name: str) -> Any:
    if isinstance(state, Mapping):
        return state.get(name)
    return getattr(state, name, None)


def _newer_persistent(persistent: PersistentTier, step: int) -> NewerSteps:
    """Persistent steps newer than the restored `step`: those never committed (no manifest:
    an abandoned save) to discard, and those with a manifest (damaged) to keep and name."""
    newer = [s for s in persistent.orbax_steps() if s > step]
    committed = [s for s in newer if (persistent.step_dir(s) / MANIFEST).exists()]
    return NewerSteps(steps=tuple(s for s in newer if s not in committed),
                      kept=tuple(committed))


class HierarchicalCheckpointer:
    """Local tier (+ partner copies) and persistent tier behind the Checkpointer protocol.

    Built from the `checkpoint:` section alone (`spmd.checkpoint.create_checkpointer`);
    `run_dir` (`run.dir`) only places the tiers that the section does not place itself.
    `events` None logs events instead of writing them; `mpi_world` None (one process, or no
    usable MPI) means no partner copies.
    """

    def __init__(self, ck: CheckpointConfig, *, run_dir: Path, env: LaunchEnv,
                 events: EventLog | None, mpi_world: MPI.Comm | None = None):
        self.rank, self.size = env.rank, env.size
        self.timeout_s, self.keep, self.use_async = ck.timeout_s, ck.keep, ck.async_
        self.local_failure = ck.local_failure
        self.events = events
        self.policy = SavePolicy.of(ck)
        local_dir, persistent_dir = tier_dirs(ck, run_dir)
        # partner copies and the agreement of steps travel over MPI point-to-point
        self.transport = (Transport.create(mpi_world, self.rank, self.size, self.timeout_s)
                          if self.size > 1 and mpi_world is not None else None)
        node_of_rank = tuple(env.node_of_rank) or tuple(range(self.size))
        holder_of, why = partner_holders(ck, node_of_rank, self.transport)
        if ck.partner and why and ck.every > 0 and self.rank == 0:
            log.warning("checkpoint.partner is on but no partner copies are made: %s", why)
        self.partner = bool(holder_of)
        # which rank writes a piece that several hold: any rank of the job, or one per process
        self.dedupe = "global" if (self.transport is not None or self.size == 1) else "process"
        self.local = (LocalTier(local_dir, self.rank, self.size, holder_of)
                      if ck.every > 0 else None)
        self.persistent = (PersistentTier(persistent_dir, self.rank, self.size,
                                          ck.persistent_every, ck.keep, ck.timeout_s,
                                          ck.async_, CheckpointCoordinator(
                                              self.rank, self.size, ck.timeout_s, "persistent"),
                                          compress=ck.compress,
                                          file_mb=ck.persistent_file_mb)
                           if self.policy.uses_persistent else None)
        self._main = CheckpointCoordinator(self.rank, self.size, ck.timeout_s, "main")
        self._local_coord = CheckpointCoordinator(self.rank, self.size, ck.timeout_s, "local")
        self._tiers = (
            _Tier("local", self.local,
                  lambda step, force, _finished: self.policy.local_due(step, force),
                  self._local_job),
            _Tier("persistent", self.persistent, self.policy.persistent_due,
                  self._persistent_job))
        self._local_tier, self._persistent_tier = self._tiers
        self._layout: SaveLayout | None = None
        self._closed = False
        self.snapshotter = Snapshotter(ck.snapshot, self.rank, ck.timeout_s)
        self._created = time.perf_counter()
        self._blocking_s = self._waited_s = 0.0
        self._snapshots = 0
        if self.rank == 0:
            local = (f"{local_dir} (every {ck.every} steps, partner copies "
                     f"{'on' if self.partner else f'off: {why}'})" if self.local else "off")
            log.info("checkpoints: local tier %s, persistent tier %s (every %d steps%s), keep %d",
                     local, persistent_dir if self.persistent else "off", ck.persistent_every,
                     ", and the final step" if ck.final else "", ck.keep)

    # ---------------------------------------------------------------- restore

    def _layout_of(self, tree: Any) -> SaveLayout:
        """The save layout, built (and the snapshot buffers allocated) on first sight."""
        if self._layout is None:
            self._layout = SaveLayout.build(tree, self.size, self.dedupe)
            self.snapshotter.prepare(self._layout, tree, local=self.local is not None,
                                     persistent=self.persistent is not None)
            if self.rank == 0:
                buffers = self.snapshotter.buffers
                self._emit("checkpoint_snapshot", mode=self.snapshotter.mode,
                           why=self.snapshotter.why,
                           host_buffer_bytes=buffers.nbytes if buffers else 0,
                           prepare_s=round(self.snapshotter.prepare_s, 4))
        return self._layout

    def restore(self, abstract_state: Any, *, optional: Sequence[str] = (),
                saves: Any = None) -> Restored | None:
        layout = self._layout_of(abstract_state if saves is None else saves)
        buffers = self.snapshotter.buffers.arrays if self.snapshotter.buffers else {}
        if saves is not None:   # restored in another form than saved: its own layout
            layout, buffers = SaveLayout.build(abstract_state, self.size, self.dedupe), {}
        variants: list[tuple[tuple[str, ...], SaveLayout]] = []
        if optional and self.local is not None:  # local copies saved without some of them
            seen = {layout.signature}
            for left_out in optional_subsets(abstract_state, optional):
                variant = SaveLayout.build(without_fields(abstract_state, left_out), self.size,
                                           self.dedupe)
                if variant.signature not in seen:
                    seen.add(variant.signature)
                    variants.append((left_out, variant))
        ctx = RestoreContext(self.rank, self.size, self._main, layout, self.local,
                             self.persistent, self.transport, self._emit, buffers,
                             variants=variants)
        restored = plan_restore(ctx, abstract_state, optional)
        if restored is None:
            return None
        if self.rank == 0:
            self._emit("restore_timing", step=restored.step, source=restored.source,
                       **{k: round(v, 4) for k, v in restored.timings.items()})
        step = restored.step
        if self.local is not None:
            for s in self.local.drop_newer(step):
                log.info("removed this rank's local step %d (newer than the restored %d)", s, step)
            self._local_tier.last = step
        if self.persistent is not None:
            persistent = self.persistent
            if self.rank != 0:   # Orbax's delete checks its cache (rank 0 reloaded it to plan)
                persistent.orbax_steps(reload=True)
            newer = self._main.agree("agree on persistent steps to discard", Vote(),
                                     lambda v: _newer_persistent(persistent, step), NewerSteps)
            for s in newer.kept:
                if self.rank == 0:
                    where = persistent.step_dir(s) / MANIFEST
                    log.warning("persistent step %d is newer than the restored step %d but was "
                                "not used (its manifest %s is damaged, or its files are); kept "
                                "for inspection: `spmd ckpt verify`", s, step, where)
                    self._emit("checkpoint_kept", step=s, tier="persistent", manifest=str(where),
                               reason=f"newer than the restored step {step} but not usable")
            for s in newer.steps:
                if self.rank == 0:
                    self._emit("checkpoint_discarded", step=s, tier="persistent",
                               reason=f"newer than the restored step {step}, never committed "
                                      "(no manifest)")
                self.persistent.delete(s)
            if step in self.persistent.committed_steps():
                self._persistent_tier.last = step
        return restored

    def newest_step(self) -> int | None:
        """Collective: the newest committed step of either tier that any rank sees (None:
        no checkpoint), as every rank's vote agreed by rank 0."""
        steps: list[int] = []
        if self.local is not None:
            steps = [s.step for s in scan_local(self.local.root) if s.committed]
        if self.rank == 0 and self.persistent is not None:
            steps += self.persistent.committed_steps(reload=True)
        decision = self._main.agree(
            "list the committed checkpoints", StepsVote(steps=tuple(steps)),
            lambda votes: NewestStep(newest=max((s for v in votes for s in v.steps),
                                                default=None)), NewestStep)
        return decision.newest

    def restore_params(self, abstract_params: Any) -> Restored | None:
        """Collective: the parameters alone of the newest committed step, onto
        `abstract_params`' shardings (checkpoint.params_only: the optimizer state, whatever
        its structure, is not read). None: no checkpoint.

        The persistent tier's `params` item (checked against its manifest) unless the local
        tier has a newer step whose every rank copy each rank can read (node-local storage
        seen whole: one node, or a shared checkpoint.local_dir)."""
        t_start = time.perf_counter()
        vote = ParamsVote(
            local=tuple(c.step for c in find_checkpoints(None, self.local.root))
            if self.local is not None else (),
            persistent=tuple(self.persistent.committed_steps(reload=True))
            if self.rank == 0 and self.persistent is not None else ())

        def decide(votes: list[ParamsVote]) -> RestorePlan:
            local = set.intersection(*(set(v.local) for v in votes))
            persistent = votes[0].persistent
            newest_local, newest_persistent = max(local, default=-1), max(persistent, default=-1)
            if max(newest_local, newest_persistent) < 0:
                return RestorePlan(plan=Plan())
            if newest_persistent >= newest_local:
                return RestorePlan(plan=Plan("persistent", newest_persistent))
            return RestorePlan(plan=Plan("local", newest_local))

        plan = self._main.agree("choose the checkpoint to read parameters from", vote, decide,
                                RestorePlan).plan
        if plan.tier is None:
            return None
        step, tier = plan.step, plan.tier
        root = self.persistent.step_dir(step) if tier == "persistent" else (
            self.local.root / str(step))   # type: ignore[union-attr]
        ckpt = ParamsCheckpoint(step, tier, root)
        params = jax.block_until_ready(read_params(ckpt, abstract_params))
        # that step is on disk already (with the older state)
        next(t for t in self._tiers if t.name == tier).last = step
        seconds = time.perf_counter() - t_start
        return Restored(step=step, state=params, source=tier,
                        detail=f"parameters only (checkpoint.params_only) of {ckpt.describe()}",
                        timings={"total_s": seconds})

    # ---------------------------------------------------------------- save

    def maybe_save(self, step: int, state: Any, *, force: bool = False,
                   finished: bool = False) -> None:
        self.check()
        due = [t for t in self._tiers
               if t.store is not None and t.last != step and t.is_due(step, force, finished)]
        if not due:
            return
        # The step that produced `state` may still be running (async dispatch): its compute
        # is not checkpoint cost, so it is waited for first and reported apart (`ready_s`).
        t_ready = time.perf_counter()
        jax.block_until_ready(state)
        ready = time.perf_counter() - t_ready
        t0 = time.perf_counter()
        for tier in due:        # one save per tier in flight at a time
            tier.worker.wait(self.timeout_s, self.rank)
        waited = time.perf_counter() - t0
        self._layout_of(state)
        # collective: every rank, same save, same answer
        finite = params_finite(split_state(state).get(PARAMS))
        if finite is False and self.rank == 0:
            log.warning("step %d: the parameters hold NaN or Inf; saved anyway, and retention "
                        "keeps the newest step whose parameters are finite", step)
        try:
            snap, waited_snap, blocking = self.snapshotter.take(step, state, len(due))
        except TimeoutError as e:
            raise CheckpointTimeout(str(e)) from e
        except Exception as e:
            raise CheckpointError(f"rank {self.rank}: snapshot ({self.snapshotter.mode}) of "
                                  f"step {step} failed: {type(e).__name__}: {e}") from e
        waited += waited_snap
        self._blocking_s += blocking
        self._waited_s += waited
        self._snapshots += 1
        timing = {"blocking_s": round(blocking, 4), "waited_s": round(waited, 4),
                  "ready_s": round(ready, 4),
                  "snapshot": snap.mode, "shared": len(due) == 2,
                  "params_finite": finite}
        for tier in due:
            job = tier.job(step, snap, timing, finite)
            tier.saves += 1
            tier.last = step
            tier.worker.submit(step, job)
            if not self.use_async:   # sync: the save is done when maybe_save returns
                tier.worker.wait(self.timeout_s, self.rank)
        if not self.use_async:
            self.check()

    @property
    def _mode(self) -> str:
        return "async" if self.use_async else "sync"

    def _local_job(self, step: int, snap: Snapshot, timing: dict,
                   finite: bool | None) -> Callable[[], None]:
        """The local tier's save of `step`, for its worker: this rank's pieces of the
        snapshot written (and its partner's copy exchanged), the commit agreed by every
        rank, then retention."""
        layout = self._layout
        assert layout is not None and self.local is not None
        pieces = layout.writes(self.rank)
        pids = [(p.leaf, p.key) for p in pieces]
        tag = step % (1 << 21)
        mode = self._mode
        local = self.local

        def job() -> None:
            try:
                try:
                    arrays, failed = snap.pieces(pids), None
                except Exception as e:
                    arrays, failed = [], (f"rank {self.rank}: host copy of the snapshot of step "
                                          f"{step} failed: {type(e).__name__}: {e}")
                # a failed rank still takes part in the partner exchange: no one waits for it
                vote = local.write(step, layout, pieces, arrays, self.transport, tag,
                                   failed=failed)
            finally:
                snap.release()
            decision = self._local_coord.agree(f"commit step {step} to the local tier", vote,
                                               decide_local, LocalCommit)
            if not decision.ok:
                local.discard(step)
                if self.rank == 0:
                    self._emit("save_failed", tier="local", step=step,
                               errors=list(decision.errors), local_failure=self.local_failure)
                message = (f"step {step} was not committed to the local tier ({local.root}): "
                           + "; ".join(decision.errors))
                if decision.timeout or self.local_failure == "stop":
                    raise CheckpointError(message)
                self._local_failed(message, own=vote.error)
                return
            try:
                local.commit(step, layout, vote.files, params_finite=finite)
            except Exception as e:
                message = (f"rank {self.rank}: writing the COMMITTED marker of step {step} in "
                           f"{local.rank_dir(step)} failed: {e}")
                if self.local_failure == "stop":
                    raise CheckpointError(message) from e
                self._emit_own_failure(step, message)
                self._local_failed(message, own=message)
                return
            dropped = local.prune(self.keep, step, decision.safe)
            if self.rank == 0:
                self._emit("saved", tier="local", step=step, mode=mode, bytes=decision.bytes,
                           seconds=round(decision.seconds, 4), **timing,
                           partner=self.partner, dropped=dropped)

        return job

    def _local_failed(self, message: str, own: str | None) -> None:
        """checkpoint.local_failure=continue: say so (rank 0 for all; a failing rank for
        itself, in its own log) and go on."""
        if self.rank == 0 or own:
            log.warning("%s; training goes on and the persistent tier still saves "
                        "(checkpoint.local_failure=continue; `stop` ends the run instead)",
                        message if self.rank == 0 else own)

    def _emit_own_failure(self, step: int, error: str) -> None:
        """A failure only this rank saw (not agreed): recorded by this rank itself."""
        self._emit("save_failed", tier="local", step=step, errors=[error],
                   local_failure=self.local_failure)

    def _persistent_job(self, step: int, snap: Snapshot, timing: dict,
                        finite: bool | None) -> Callable[[], None]:
        """The persistent tier's save of `step`, for its worker: "can rank 0 create the
        step's directory" agreed, Orbax's save of the snapshot, the commit agreed."""
        assert self.persistent is not None
        persistent = self.persistent
        mode = self._mode

        def job() -> None:
            error = None
            t0 = time.perf_counter()
            try:
                writable = persistent.agree_writable(step)   # collective: every rank
            except BaseException:
                snap.release()
                raise
            if not writable.ok:      # no rank calls Orbax's save: nobody waits in it
                snap.release()
                if self.rank == 0:
                    self._emit("save_failed", tier="persistent", step=step,
                               errors=list(writable.errors))
                raise persistent_error(writable, step)
            try:
                arrays = snap.arrays()
                persistent.start_save(step, arrays)   # Orbax's copy of the snapshot
                del arrays
                persistent.release_arrays(step)   # the chunk checksums' pass read them
            except Exception as e:
                error = (f"rank {self.rank}: persistent save of step {step} to "
                         f"{persistent.step_dir(step)} failed to start: {type(e).__name__}: {e}")
            finally:
                snap.release()
            started = time.perf_counter() - t0
            decision = persistent.finish_save(step, error, finite)
            if not decision.ok:
                if self.rank == 0:
                    self._emit("save_failed", tier="persistent", step=step,
                               errors=list(decision.errors))
                raise persistent_error(decision, step)
            if self.rank == 0:
                self._emit("saved", tier="persistent", step=step, mode=mode,
                           bytes=decision.bytes,
                           files=decision.files, seconds=round(decision.seconds, 4),
                           orbax_start_s=round(started, 4),
                           orbax_wait_s=round(decision.orbax_s, 4),
                           **decision.phases, dropped=list(decision.drop), **timing)

        return job

    # ---------------------------------------------------------------- errors, close

    def check(self) -> None:
        for tier in self._tiers:
            tier.worker.raise_error()

    def wait(self) -> None:
        """Wait for every save in flight (bounded by checkpoint.timeout_s each); raise errors."""
        errors = []
        for tier in self._tiers:
            try:
                tier.worker.wait(self.timeout_s, self.rank)
            except CheckpointError as e:
                errors.append(e)
        if errors:
            raise errors[0]

    def summary(self) -> dict:
        """Blocking and waiting totals since creation, and their fraction of wall time."""
        wall = time.perf_counter() - self._created
        stalled = self._blocking_s + self._waited_s
        return {"wall_s": round(wall, 3), "blocking_s": round(self._blocking_s, 4),
                "waited_s": round(self._waited_s, 4),
                "blocked_fraction": round(stalled / wall, 6) if wall > 0 else 0.0,
                "snapshots": self._snapshots,
                "saves": {tier.name: tier.saves for tier in self._tiers},
                "snapshot": self.snapshotter.mode or None}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.wait()
        finally:
            summary = self.summary()
            log.info("checkpoints blocked training for %.3f s and made it wait %.3f s: %.2f%% "
                     "of %.1f s wall time (%d local, %d persistent saves)",
                     summary["blocking_s"], summary["waited_s"],
                     100 * summary["blocked_fraction"], summary["wall_s"],
                     summary["saves"]["local"], summary["saves"]["persistent"])
            if self.rank == 0:
                self._emit("checkpoint_summary", **summary)
            if self.persistent is not None and not any(t.worker.busy() for t in self._tiers):
                try:
                    self.persistent.close()
                except Exception as e:  # closing must not hide the save error above
                    log.warning("closing the Orbax CheckpointManager: %s", e)

    def _emit(self, event: str, **fields: Any) -> None:
        if self.events is not None:
            self.events.emit(event, **fields)
        else:
            log.info("%s %s", event, fields)

