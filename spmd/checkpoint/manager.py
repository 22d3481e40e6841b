"""The hierarchical checkpointer the trainer talks to: when to save, async workers, honesty.

`maybe_save` blocks only for the device-to-host copy of this process's pieces (local tier)
and for Orbax's own copy (persistent tier); the writes, partner exchange, agreement and
commit run in one background thread per tier. A save that fails anywhere is raised on every
rank at the next `maybe_save`/`check`/`close`, naming rank and path; the failed step is
never committed, so the previous one stays the latest.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import jax

from spmd.checkpoint.api import CheckpointError, Restored
from spmd.checkpoint.coord import CheckpointTimeout, Coordinator
from spmd.checkpoint.layout import SaveLayout, snapshot
from spmd.checkpoint.local import LocalTier, partner_map
from spmd.checkpoint.persistent import PersistentTier, persistent_error
from spmd.checkpoint.policy import SavePolicy, tier_dirs
from spmd.checkpoint.restore import RestoreContext
from spmd.checkpoint.restore import restore as plan_restore
from spmd.checkpoint.transport import Transport

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


def _decide_local(votes: list[dict]) -> dict:
    errors = [v.get("error", f"rank {r} failed") for r, v in enumerate(votes) if not v.get("ok")]
    if errors:
        return {"ok": False, "errors": errors}
    newest = [v.get("newest") for v in votes]
    return {"ok": True, "bytes": sum(v["bytes"] for v in votes),
            "safe": None if any(n is None for n in newest) else min(newest),
            "seconds": max(v["seconds"] for v in votes)}


class HierarchicalCheckpointer:
    """Local tier (+ partner copies) and persistent tier behind the Checkpointer protocol."""

    def __init__(self, cfg: Any, env: Any, events: Any, *, mpi_world: Any = None):
        ck = cfg.checkpoint
        self.rank, self.size = env.rank, env.size
        self.timeout_s, self.keep, self.use_async = ck.timeout_s, ck.keep, ck.async_
        self.events = events
        self.policy = SavePolicy(ck.every, ck.persistent_every)
        local_dir, persistent_dir = tier_dirs(cfg)
        node_of_rank = tuple(env.node_of_rank) or tuple(range(self.size))
        num_nodes = len(set(node_of_rank))
        want_partner = ck.partner if ck.partner is not None else num_nodes > 1
        self.transport = (Transport.create(mpi_world, self.rank, self.size, self.timeout_s)
                          if self.size > 1 and mpi_world is not None else None)
        holder_of, why = {}, "checkpoint.partner is off" if want_partner is False else (
            "there is only one node")
        if ck.every > 0 and want_partner:
            holder_of = partner_map(node_of_rank)
            why = ("there is only one node (checkpoint.partner needs two)" if not holder_of else
                   "MPI is not available (partner copies travel over MPI point-to-point)"
                   if self.transport is None else "")
            if why:
                holder_of = {}
                if ck.partner and self.rank == 0:
                    log.warning("checkpoint.partner is on but no partner copies are made: %s",
                                why)
        self.partner = bool(holder_of)
        dedupe = "global" if (self.transport is not None or self.size == 1) else "process"
        self.dedupe = dedupe
        self.local = (LocalTier(local_dir, self.rank, self.size, holder_of)
                      if ck.every > 0 else None)
        self.persistent = (PersistentTier(persistent_dir, self.rank, self.size,
                                          ck.persistent_every, ck.keep, ck.timeout_s,
                                          ck.async_, Coordinator(self.rank, self.size,
                                                                 ck.timeout_s, "persistent"),
                                          compress=ck.compress)
                           if ck.persistent_every > 0 else None)
        self._main = Coordinator(self.rank, self.size, ck.timeout_s, "main")
        self._local_coord = Coordinator(self.rank, self.size, ck.timeout_s, "local")
        self._workers = {"local": _Worker("local"), "persistent": _Worker("persistent")}
        self._last: dict[str, int | None] = {"local": None, "persistent": None}
        self._layout: SaveLayout | None = None
        self._closed = False
        if self.rank == 0:
            log.info("checkpoints: local tier %s (every %d steps, partner copies %s), persistent "
                     "tier %s (every %d steps), keep %d", local_dir if self.local else "off",
                     ck.every, "on" if self.partner else f"off: {why}",
                     persistent_dir if self.persistent else "off", ck.persistent_every, ck.keep)

    # ---------------------------------------------------------------- restore

    def _layout_of(self, tree: Any) -> SaveLayout:
        if self._layout is None:
            self._layout = SaveLayout.build(tree, self.size, self.dedupe)
        return self._layout

    def restore(self, abstract_state: Any) -> Restored | None:
        layout = self._layout_of(abstract_state)
        ctx = RestoreContext(self.rank, self.size, self._main, layout, self.local,
                             self.persistent, self.transport, self._emit)
        restored = plan_restore(ctx, abstract_state)
        if restored is None:
            return None
        step = restored.step
        if self.local is not None:
            for s in self.local.drop_newer(step):
                log.info("removed this rank's local step %d (newer than the restored %d)", s, step)
            self._last["local"] = step
        if self.persistent is not None:
            persistent = self.persistent
            persistent.orbax_steps(reload=True)  # every rank: Orbax's delete checks its cache
            newer = self._main.agree("agree on persistent steps to discard", {"ok": True},
                                     lambda v: {"ok": True, "steps": [
                                         s for s in persistent.orbax_steps() if s > step]})
            for s in newer["steps"]:
                if self.rank == 0:
                    self._emit("checkpoint_discarded", step=s, tier="persistent",
                               reason=f"newer than the restored step {step} but not usable")
                self.persistent.delete(s)
            if step in self.persistent.committed_steps():
                self._last["persistent"] = step
        return restored

    # ---------------------------------------------------------------- save

    def maybe_save(self, step: int, state: Any, *, force: bool = False) -> None:
        self.check()
        local_due = (self.local is not None and self.policy.local_due(step, force)
                     and self._last["local"] != step)
        persistent_due = (self.persistent is not None and self.policy.persistent_due(step, force)
                          and self._last["persistent"] != step)
        if local_due:
            self._save_local(step, state)
        if persistent_due:
            self._save_persistent(step, state)
        if not self.use_async:
            self.check()

    def _save_local(self, step: int, state: Any) -> None:
        worker = self._workers["local"]
        t0 = time.perf_counter()
        worker.wait(self.timeout_s, self.rank)  # one local save in flight at a time
        waited = time.perf_counter() - t0
        layout = self._layout_of(state)
        pieces = layout.writes(self.rank)
        t1 = time.perf_counter()
        arrays = snapshot(jax.tree.leaves(state), pieces)
        blocking = time.perf_counter() - t1
        self._last["local"] = step
        tag = step % (1 << 21)
        mode = "async" if self.use_async else "sync"  # sync: maybe_save also waits for the job
        assert self.local is not None
        local = self.local

        def job() -> None:
            vote = local.write(step, layout, pieces, arrays, self.transport, tag)
            decision = self._local_coord.agree(f"commit step {step} to the local tier", vote,
                                               _decide_local)
            if not decision["ok"]:
                local.discard(step)
                if self.rank == 0:
                    self._emit("save_failed", tier="local", step=step, errors=decision["errors"])
                raise CheckpointError(f"step {step} was not committed to the local tier "
                                      f"({local.root}): " + "; ".join(decision["errors"]))
            try:
                local.commit(step, layout, vote["files"])
            except Exception as e:
                raise CheckpointError(f"rank {self.rank}: writing the COMMITTED marker of step "
                                      f"{step} in {local.rank_dir(step)} failed: {e}") from e
            dropped = local.prune(self.keep, step, decision["safe"])
            if self.rank == 0:
                self._emit("saved", tier="local", step=step, mode=mode, bytes=decision["bytes"],
                           seconds=round(decision["seconds"], 4), blocking_s=round(blocking, 4),
                           waited_s=round(waited, 4), partner=self.partner, dropped=dropped)

        worker.submit(step, job)
        if not self.use_async:
            worker.wait(self.timeout_s, self.rank)

    def _save_persistent(self, step: int, state: Any) -> None:
        assert self.persistent is not None
        persistent = self.persistent
        worker = self._workers["persistent"]
        worker.wait(self.timeout_s, self.rank)
        t0 = time.perf_counter()
        try:
            persistent.start_save(step, state)
        except Exception as e:
            raise CheckpointError(f"rank {self.rank}: persistent save of step {step} to "
                                  f"{persistent.step_dir(step)} failed to start: "
                                  f"{type(e).__name__}: {e}") from e
        blocking = time.perf_counter() - t0
        self._last["persistent"] = step
        mode = "async" if self.use_async else "sync"

        def job() -> None:
            decision = persistent.finish_save(step)
            if not decision["ok"]:
                if self.rank == 0:
                    self._emit("save_failed", tier="persistent", step=step,
                               errors=decision.get("errors"))
                raise persistent_error(decision, step)
            if self.rank == 0:
                self._emit("saved", tier="persistent", step=step, mode=mode,
                           bytes=decision["bytes"],
                           files=decision["files"], seconds=round(decision["seconds"], 4),
                           orbax_wait_s=round(decision["orbax_s"], 4),
                           blocking_s=round(blocking, 4))

        worker.submit(step, job)
        if not self.use_async:
            worker.wait(self.timeout_s, self.rank)

    # ---------------------------------------------------------------- errors, close

    def check(self) -> None:
        for worker in self._workers.values():
            worker.raise_error()

    def wait(self) -> None:
        """Wait for every save in flight (bounded by checkpoint.timeout_s each); raise errors."""
        errors = []
        for worker in self._workers.values():
            try:
                worker.wait(self.timeout_s, self.rank)
            except CheckpointError as e:
                errors.append(e)
        if errors:
            raise errors[0]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.wait()
        finally:
            if self.persistent is not None and not any(w.busy() for w in self._workers.values()):
                try:
                    self.persistent.close()
                except Exception as e:  # closing must not hide the save error above
                    log.warning("closing the Orbax CheckpointManager: %s", e)

    def _emit(self, event: str, **fields: Any) -> None:
        if self.events is not None:
            self.events.emit(event, **fields)
        else:
            log.info("%s %s", event, fields)
