"""The persistent tier: a global Orbax checkpoint per step, plus our own checksum manifest.

Orbax (CheckpointManager, StandardSave/StandardRestore) writes a reshardable checkpoint that
restores onto any mesh and process count. A step holds two Orbax items: `params` (the
parameters alone, a pure dict: what `spmd.load`, `spmd eval` and a plain
`ocp.StandardCheckpointer().restore(<step>/params, target)` read) and `train_state` (every
other field of the state: step, optimizer state, RNG key). Steps written before this split
hold one item, `default`, with the whole state; they restore as before. Steps written before
a field was added to the state (the RNG key) restore when the caller names that field
optional: it comes back as None, for the caller to fill.

Checksums without a second pass (spmd.checkpoint.step_manifest, .chunk_sums, .chunks): the
arrays are written as Zarr v3; while Orbax writes them, a thread computes the crc32c of every
chunk from the host arrays Orbax was handed (hardware crc32c, no copy on CPU); compressed
steps carry TensorStore's crc32c codec in each chunk instead. After Orbax has finalized a
step every process fsyncs the files it wrote (`ocdbt.process_<i>/`,
`array_metadatas/process_<i>`; rank 0 the rest), once each, and lists them: a data file
(`ocdbt.process_<i>/d/`, at least `SMALL_FILE` bytes) is recorded with its size and
`"check": "chunks"`, never read back (about eight per process and step, written at once:
spmd.checkpoint.data_files); the small files (Orbax's JSON metadata, OCDBT
manifests and b-tree nodes: kilobytes) get a crc32c of their bytes. Rank 0 gathers the lists
and the chunks' crc32c and writes `<step>/spmd_manifest.json` (format `spmd-persistent/3`).
A step counts as committed only when that manifest exists: a step Orbax finalized but we
could not vouch for is neither restored nor counted by retention, so it never pushes out the
newest step we can vouch for. Manifests of formats `spmd-persistent/1` (a zlib crc32 of
every file) and `/2` (TensorStore's crc32c in every chunk) are still read and checked.

Invariants
- Before Orbax's save of a step the ranks agree (`agree_writable`) that rank 0, the process
  that creates Orbax's directories, can create one in the root: when it cannot, no rank calls
  Orbax's save (whose barrier would otherwise hold the other ranks for `checkpoint.timeout_s`)
  and every rank raises the same one-line error naming the root and
  `checkpoint.persistent_dir`. Votes and decisions are typed (spmd.comm.agreement's `Vote`
  and `Decision`; the commit's `PersistentVote` and `PersistentCommit`).
- The manifest records `params_finite` (spmd.checkpoint.finite); retention never deletes the
  newest committed step whose parameters are finite (absent: finite), besides the newest
  `keep`. Which steps go is decided once, by rank 0 inside the commit agreement.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spmd.checkpoint.chunk_sums import ChunkSums
from spmd.checkpoint.chunks import install_chunk_checksums
from spmd.checkpoint.data_files import share_of_state, target_file_bytes
from spmd.checkpoint.files import fsync_dir, remove_tree
from spmd.checkpoint.finite import count_nonfinite, marked_finite
from spmd.checkpoint.interface import CheckpointError
from spmd.checkpoint.reader import Unsupported, read_item, supports
from spmd.checkpoint.state_items import (
    LEGACY_ITEM,
    PARAMS,
    TRAIN_STATE,
    join_state,
    present_fields,
    split_state,
    without_fields,
)
from spmd.checkpoint.step_manifest import (  # noqa: F401  (re-exported: the tier's names)
    FORMAT,
    FORMATS,
    MANIFEST,
    SMALL_FILE,
    PersistentCommit,
    PersistentVote,
    checksum_files,
    file_owner,
    prefetch,
    read_manifest,
    verify_files,
    write_manifest,
)
from spmd.comm.agreement import Coordinator, Decision, Vote

log = logging.getLogger("spmd.checkpoint")

TRASH = ".spmd-dropped-"  # a dropped step, renamed (atomic), removed in the background


def retained(manifests: dict[int, dict | None], keep: int) -> set[int]:
    """The committed steps retention keeps: the newest `keep`, and the newest whose
    parameters are finite (`params_finite` absent counts as finite)."""
    good = sorted(s for s, m in manifests.items() if m is not None)
    kept = set(good[-keep:]) if keep > 0 else set()
    finite = [s for s in good if marked_finite(manifests[s])]
    if finite:
        kept.add(finite[-1])
    return kept


@dataclass
class VerifiedLatestN:
    """Orbax preservation policy: keep the newest `n` steps that have our manifest, and the
    newest of those whose parameters are finite.

    Steps newer than the newest verified one (a save in flight) are kept too; older
    unverified steps (Orbax finalized, manifest never written) are not.
    """

    n: int
    root: Path

    def should_preserve(self, checkpoints: Any, *, context: Any) -> list[bool]:
        manifests = {c.step: ((read_manifest(self.root / str(c.step)) or {})
                              if (self.root / str(c.step) / MANIFEST).is_file() else None)
                     for c in checkpoints}
        good = [s for s, m in manifests.items() if m is not None]
        keep = retained(manifests, self.n)
        newest = max(good) if good else -1
        return [c.step in keep or c.step > newest for c in checkpoints]


def probe_writable(root: Path) -> str | None:
    """None when a directory can be created (and removed) in `root`, else why not.

    Cheap: one mkdir and one rmdir of a hidden probe (never a step, never seen by Orbax).
    """
    probe = root / f".spmd-write-probe-{os.getpid()}"
    try:
        probe.mkdir(parents=True, exist_ok=True)
        probe.rmdir()
    except OSError as e:
        return e.strerror or f"{type(e).__name__}: {e}"
    return None


def use_kv_store_barriers() -> None:
    """Make Orbax's barriers key-value-store barriers (jax.distributed client, with timeouts).

    By default Orbax's `sync_global_processes` is `sync_global_devices`, a device collective:
    run from the checkpointer's background thread while the training thread runs its own
    collectives, ranks can order the two differently and deadlock (seen with gloo on CPU).
    Orbax's flag `experimental_orbax_use_distributed_barrier` switches to the coordination
    service's `wait_at_barrier`, which Orbax documents as safe from background threads. The
    flag is process-wide; it is set whether or not absl flags were parsed.
    """
    from absl import flags

    try:
        flag = flags.FLAGS["experimental_orbax_use_distributed_barrier"]
    except KeyError:  # an Orbax without the flag: barriers stay device collectives
        log.warning("this Orbax has no experimental_orbax_use_distributed_barrier flag; its "
                    "barriers are device collectives")
        return
    flag.value = True
    flag.present = 1   # readable before absl parses flags (we never parse them)


class PersistentTier:
    """One Orbax CheckpointManager plus manifests; every rank holds one.

    Its `start_save` runs on the checkpointer's background thread (on a snapshot), so with
    more than one process Orbax's barriers are switched to the key-value store first.
    """

    def __init__(self, root: Path, rank: int, size: int, every: int, keep: int,
                 timeout_s: float, use_async: bool, coord: Coordinator, compress: bool = False,
                 file_mb: int | None = None):
        import orbax.checkpoint as ocp

        self.root, self.rank, self.size, self.coord = root, rank, size, coord
        self.keep = keep
        self._ocp, self.compress, self.file_mb = ocp, compress, file_mb
        if size > 1:
            use_kv_store_barriers()
        # Zarr v3, every chunk's crc32c known without reading the files back: computed from
        # the host arrays while Orbax writes and kept in the manifest (spmd.checkpoint.
        # chunk_sums), or, compressed, by TensorStore's crc32c codec inside each chunk
        # (spmd.checkpoint.chunks). Weights barely compress (~8%) and zstd costs far more CPU
        # time than the bytes it saves cost on a parallel file system, so compression is off
        # unless `compress`. Any of these restores with any handler (Orbax reads the format
        # from the files).
        self.chunk_crc = install_chunk_checksums() or not compress
        self._standard = compress and not self.chunk_crc
        self._sums: dict[int, ChunkSums] = {}   # step -> its chunks' crc32c, being computed

        def handler() -> Any:
            if self._standard:
                return ocp.StandardCheckpointHandler()
            return ocp.PyTreeCheckpointHandler(use_compression=compress,
                                               use_zarr3=self.chunk_crc)

        handlers = {PARAMS: handler(), TRAIN_STATE: handler(), LEGACY_ITEM: handler()}
        options = ocp.CheckpointManagerOptions(
            enable_async_checkpointing=use_async,
            async_options=ocp.options.AsyncOptions(timeout_secs=max(1, int(timeout_s)),
                                                   create_directories_asynchronously=False),
            preservation_policy=VerifiedLatestN(keep, root),
            save_decision_policy=ocp.checkpoint_managers.FixedIntervalPolicy(max(every, 1)),
            cleanup_tmp_directories=True,
            create=True,
        )
        try:
            self.manager = ocp.CheckpointManager(root, options=options, item_handlers=handlers)
        except Exception as e:
            raise CheckpointError(f"rank {rank}: cannot open the persistent tier at {root} "
                                  f"(checkpoint.persistent_dir): {type(e).__name__}: {e}") from e
        self._removers: list[threading.Thread] = []
        self._remove_trash()   # steps dropped by a run that ended before removing them

    def step_dir(self, step: int) -> Path:
        return self.root / str(step)

    def _remove_trash(self) -> None:
        """Remove dropped steps (renamed to `TRASH`...) in the background: rank 0 only."""
        if self.rank != 0:
            return
        trash = [p for p in self.root.glob(f"{TRASH}*") if p.is_dir()]
        if trash:
            worker = threading.Thread(target=lambda: [remove_tree(p) for p in trash],
                                      name="spmd-ckpt-drop", daemon=True)
            worker.start()
            self._removers.append(worker)

    def orbax_steps(self, reload: bool = False) -> list[int]:
        """Steps Orbax finalized (`reload`: rescan the directory, this rank only)."""
        if reload:
            self.manager.reload()
        return sorted(self.manager.all_steps())

    def committed_steps(self, reload: bool = False) -> list[int]:
        return [s for s in self.orbax_steps(reload)
                if read_manifest(self.step_dir(s)) is not None]

    def due(self, step: int) -> bool:
        return bool(self.manager.should_save(step))

    def agree_writable(self, step: int) -> Decision:
        """Collective, before `start_save`: can rank 0 create step `step`'s directory?

        Rank 0 creates Orbax's directories and the others wait for it in Orbax's barrier,
        so a rank 0 that cannot would hold them there for `checkpoint.timeout_s`. Decided
        first, every rank learns it at once: `ok` False (and its `errors`) means no rank
        may call Orbax's save.
        """
        vote = Vote()
        if self.rank == 0:
            why = probe_writable(self.root)
            if why is not None:
                vote = Vote(ok=False, error=(
                    f"rank 0: cannot create step {step}'s directory in {self.root} "
                    f"(checkpoint.persistent_dir): {why}"))
        return self.coord.agree(f"check that persistent step {step} can be written", vote)

    def start_save(self, step: int, state: Any) -> None:
        """Orbax's blocking part (its own copy of `state`); the writes go on in its threads.

        Called from the checkpointer's background thread on a snapshot, never on the live
        state: training does not wait for it.
        """
        if step in self.manager.all_steps():
            self.delete(step)  # unverified leftover of an earlier incarnation
        args = self._ocp.args
        trees = split_state(state)
        self._sums.pop(step, None)
        if self._standard:
            size, items = None, {name: args.StandardSave(tree) for name, tree in trees.items()}
        else:   # several data files, written at once (spmd.checkpoint.data_files); Orbax
            # also cuts a shard larger than that size into chunks of at most that size: the
            # same size on every process
            size = target_file_bytes(share_of_state(trees), self.file_mb)
            items = {name: args.PyTreeSave(tree, ocdbt_target_data_file_size=size)
                     for name, tree in trees.items()}
        sums = None if self.compress else ChunkSums(trees, size)
        self.manager.save(step, args=args.Composite(**items), force=True)
        if sums is not None:   # the crc32c of the chunks, while Orbax writes them
            self._sums[step] = sums.start()

    def release_arrays(self, step: int) -> None:
        """Return once nothing of this save refers to the arrays `start_save` was handed
        (Orbax has its own copy; the chunk checksums' pass has read them): the snapshot can
        be released, and on an accelerator its device copy freed before the next save."""
        sums = self._sums.get(step)
        if sums is not None:
            sums.wait_pass()

    def finish_save(self, step: int, error: str | None = None,
                    params_finite: bool | None = None) -> PersistentCommit:
        """Wait for Orbax, checksum this rank's files, agree, and write the manifest (rank 0).

        `error`: this rank's save failed to start; it still votes, so no rank waits in vain.
        `params_finite`: whether the step's parameters are finite (None: unknown), recorded
        in the manifest for retention.
        """
        t0 = time.perf_counter()
        where = self.step_dir(step)
        orbax_s = checksum_s = 0.0
        sums = self._sums.pop(step, None)
        try:
            if error is not None:
                raise _StartFailed(error)
            self.manager.wait_until_finished()
            orbax_s = time.perf_counter() - t0
            if not where.is_dir():
                raise FileNotFoundError(f"{where} is missing after Orbax finished the save")
            files = checksum_files(where, self.rank, self.size, chunk_crc=self.chunk_crc)
            chunks = {} if sums is None else sums.result(where, self.rank)
            checksum_s = time.perf_counter() - t0 - orbax_s
            vote = PersistentVote(files=files, chunks=chunks)
        except _StartFailed as e:
            vote = PersistentVote(ok=False, error=str(e))
        except Exception as e:
            vote = PersistentVote(ok=False, error=f"rank {self.rank}: persistent save of step "
                                  f"{step} to {where} failed: {type(e).__name__}: {e}")
        t1 = time.perf_counter()
        decision = self.coord.agree(
            f"finish the persistent save of step {step}", vote,
            lambda votes: self._commit(where, step, votes, params_finite), PersistentCommit)
        t2 = time.perf_counter()
        if decision.ok:
            self.drop(list(decision.drop))
            # orbax_s: this rank's wait for Orbax; the rest: our manifest. Where the rest went:
            # fsync + checksums of this rank's files, the agreement (rank 0: manifest write +
            # retention decision inside it), forgetting dropped steps
            decision = dataclasses.replace(
                decision, seconds=time.perf_counter() - t0, orbax_s=orbax_s,
                phases={"checksum_fsync_s": round(checksum_s, 4),
                        # the chunks' crc32c (this rank), overlapping Orbax's write
                        "chunk_crc_s": round(sums.seconds if sums else 0.0, 4),
                        "commit_s": round(t2 - t1, 4),
                        "drop_s": round(time.perf_counter() - t2, 4)})
        return decision

    def _commit(self, where: Path, step: int, votes: list[PersistentVote],
                params_finite: bool | None = None) -> PersistentCommit:
        """Rank 0, inside the agreement: the manifest, then which committed steps retention
        drops (beyond the newest `keep`, never the newest with finite parameters), renamed
        away here. Decided once and broadcast: ranks that listed the directory themselves,
        while rank 0 was already deleting, disagreed on the list (and, with Orbax's collective
        delete, waited in different barriers for ever)."""
        decision = write_manifest(where, step, votes, self.size, params_finite)
        if decision.ok:
            manifests = {s: read_manifest(self.step_dir(s))
                         for s in self.orbax_steps(reload=True)}
            kept = retained(manifests, self.keep)
            decision = dataclasses.replace(decision, drop=tuple(self._rename_away(
                [s for s, m in sorted(manifests.items()) if m is not None and s not in kept])))
        return decision

    def _rename_away(self, steps: list[int]) -> list[int]:
        """Rank 0: rename the steps retention drops out of Orbax's sight (atomic; their
        files are removed in the background, off the save's path); the steps renamed."""
        done = []
        for step in steps:
            try:
                os.replace(self.step_dir(step),
                           self.root / f"{TRASH}{step}-{os.getpid()}-{time.monotonic_ns()}")
                done.append(step)
            except OSError as e:
                log.warning("persistent step %d could not be dropped (%s): kept for now",
                            step, e.strerror or e)
        if done:
            fsync_dir(self.root)
        return done

    def drop(self, steps: list[int]) -> None:
        """Forget `steps`, which rank 0 chose and renamed away for every rank (each rank
        reloads Orbax's list of steps); rank 0 then removes their files in the background.

        Orbax applies the preservation policy while the new step has no manifest yet, so it
        keeps that step besides the `keep` committed ones; this brings the tier back to `keep`.
        """
        if steps:
            self.manager.reload()
            self._remove_trash()

    def prefetch(self, step: int) -> None:
        """Start reading `step`'s data files (this rank's share) ahead of the restore."""
        manifest = read_manifest(self.step_dir(step))
        if manifest is not None:
            prefetch(self.step_dir(step), manifest, self.rank, self.size)

    def verify(self, step: int, deep: bool = True) -> list[str]:
        """This rank's share of the manifest check of `step` (all ranks together check all);
        without `deep`, data files' chunks are left to the restore's reads (TensorStore checks
        their crc32c)."""
        manifest = read_manifest(self.step_dir(step))
        if manifest is None:
            return [f"{self.step_dir(step) / MANIFEST}: missing or unreadable"]
        return verify_files(self.step_dir(step), manifest, self.rank, self.size, deep)

    def restore(self, step: int, abstract_state: Any, optional: Sequence[str] = (),
                orbax: bool = True) -> tuple[Any, tuple[str, ...]]:
        """Onto `abstract_state`'s shardings: any mesh, any process count (either layout).

        Returns the state and the `optional` top-level fields the step does not hold (None
        in the state): it was written before they existed. An optional field the step holds
        but `abstract_state` does not (None: the EMA of a run that switched it off) is not
        read. Without `orbax`, an item spmd's reader does not understand raises
        `Unsupported` instead of being read by Orbax (whose barriers need every rank).
        """
        legacy, fields, target, items, partial, missing = self._items(step, abstract_state,
                                                                      optional)
        restored = self._read_items(step, items, partial, orbax)
        if legacy:
            whole = restored[LEGACY_ITEM]
            return (whole if fields is None or not dataclasses.is_dataclass(target)
                    else dataclasses.replace(target, **whole)), missing
        return join_state(target, {name: restored[name] for name in items}), missing

    def readable(self, step: int, abstract_state: Any, optional: Sequence[str] = ()) -> bool:
        """Whether spmd's reader reads every item of `step` onto `abstract_state` (from the
        metadata alone; False where it cannot be read)."""
        try:
            _, _, _, items, partial, _ = self._items(step, abstract_state, optional)
        except Exception:
            return False
        sums = self._chunk_sums(step)
        return all(supports(self.step_dir(step) / name, tree, name in partial, sums.get(name))
                   for name, tree in items.items())

    def _chunk_sums(self, step: int) -> dict[str, dict[str, str]]:
        """{item: {chunk key: crc32c}} from the step's manifest (format /3; else empty)."""
        return (read_manifest(self.step_dir(step)) or {}).get("chunks") or {}

    def _items(self, step: int, abstract_state: Any, optional: Sequence[str]) -> tuple:
        """(legacy, fields, target, {item: its target}, partial items, missing fields)."""
        legacy = (self.step_dir(step) / LEGACY_ITEM).is_dir()
        stored = self._stored_fields(step, LEGACY_ITEM if legacy else TRAIN_STATE) \
            if optional else None
        missing = tuple(n for n in optional if stored is not None and n not in stored)
        target = without_fields(abstract_state, missing)
        unread = [n for n in optional if stored is not None and n in stored
                  and present_fields(target) is not None and n not in present_fields(target)]
        if unread:
            log.info("persistent step %d holds %s, which this run's state does not have: "
                     "not restored", step, ", ".join(unread))
        partial = {LEGACY_ITEM if legacy else TRAIN_STATE} if unread else set()
        fields = None
        if legacy:  # the whole state in one item; absent fields are not in its tree
            fields = present_fields(target)
            items = {LEGACY_ITEM: target if fields is None else fields}
        else:
            items = split_state(target)
        return legacy, fields, target, items, partial, missing

    def _read_items(self, step: int, items: Mapping[str, Any], partial: set[str],
                    orbax: bool = True) -> dict:
        """Each item of `step` onto its target: spmd's reader (spmd.checkpoint.reader: the
        chunks read once, their crc32c checked in hardware) where it understands the item,
        else Orbax's restore (older formats, compressed steps; it raises where the step does
        not fit the target). TensorStore does not know the manifest's chunk crc32c (format
        /3), so one process checks such an item in full before Orbax reads it; several
        processes reach Orbax's read only after their split full check (spmd.checkpoint.
        restore)."""
        restored: dict[str, Any] = {}
        sums = self._chunk_sums(step)
        for name, tree in items.items():
            try:
                restored[name] = read_item(self.step_dir(step) / name, tree, name in partial,
                                           sums=sums.get(name))
            except Unsupported as e:
                if not orbax:
                    raise
                log.debug("persistent step %d, item %s: read by Orbax (%s)", step, name, e)
        rest = {name: tree for name, tree in items.items() if name not in restored}
        if self.size == 1 and any(sums.get(name) for name in rest):
            self._check_items(step, [name for name in rest if sums.get(name)])
        if rest:
            restored.update(self.manager.restore(step, args=self._ocp.args.Composite(
                **{name: self._restore_args(tree, name in partial)
                   for name, tree in rest.items()})))
        return restored

    def _check_items(self, step: int, names: list[str]) -> None:
        """The full check of items' files (every chunk read once), raising on damage."""
        manifest = read_manifest(self.step_dir(step)) or {"files": {}}
        files = {rel: want for rel, want in manifest["files"].items()
                 if rel.split("/", 1)[0] in names}
        problems = verify_files(self.step_dir(step), {**manifest, "files": files}, 0, 1)
        if problems:
            raise CheckpointError("; ".join(problems))

    def _stored_fields(self, step: int, item: str) -> set[str] | None:
        """Top-level keys of a step's item, from Orbax's metadata (None: unreadable)."""
        try:
            meta = self.manager.item_metadata(step)[item]
        except Exception:
            return None
        tree = getattr(meta, "tree", meta)
        return set(tree) if isinstance(tree, Mapping) else None

    def _restore_args(self, target: Any, partial: bool = False) -> Any:
        if self._standard:
            return self._ocp.args.StandardRestore(target, strict=not partial)
        return restore_args(target, partial)

    def delete(self, step: int) -> None:
        """Collective: every rank calls it."""
        self.manager.delete(step)

    def wait_removals(self) -> None:
        """Return once the dropped steps being removed in the background are gone."""
        while self._removers:
            self._removers.pop().join()

    def close(self) -> None:
        self.manager.close()
        self.wait_removals()


def restore_args(target: Any, partial: bool = False) -> Any:
    """Orbax restore arguments onto `target`'s shapes, dtypes and shardings (either handler
    reads what either wrote). `partial`: the stored tree may hold more (not read)."""
    import orbax.checkpoint as ocp

    return ocp.args.PyTreeRestore(
        item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
        partial_restore=partial)


class _StartFailed(Exception):
    """This rank's Orbax save raised before it got going (message names rank and path)."""


def persistent_error(decision: Decision, step: int) -> CheckpointError:
    return CheckpointError(f"step {step} was not committed to the persistent tier: "
                           + "; ".join(decision.errors or [decision.error or "?"]))


def nonfinite_persistent(step_dir: Path) -> dict[str, tuple[int, int]]:
    """{parameter path: (non-finite count, size)} of a persistent step's parameters, read
    onto the host with Orbax (the `params` item; the `params` subtree of a legacy step)."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    from spmd.sharding import path_str

    legacy = not (step_dir / PARAMS).is_dir() and (step_dir / LEGACY_ITEM).is_dir()
    item = step_dir / (LEGACY_ITEM if legacy else PARAMS)
    with ocp.PyTreeCheckpointer() as checkpointer:
        meta = checkpointer.metadata(item)
        tree = getattr(meta, "item_metadata", meta)
        tree = getattr(tree, "tree", tree)
        args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
        restored = checkpointer.restore(item, args=ocp.args.PyTreeRestore(
            item=tree, restore_args=args))
    if legacy:
        restored = restored.get("params", {}) if isinstance(restored, Mapping) else {}
    flat, _ = jax.tree_util.tree_flatten_with_path(restored)
    out = {}
    for path, value in flat:
        values = np.asarray(value)
        out[path_str(path)] = (count_nonfinite(values), values.size)
    return out
