"""Checkpoint costs, measured against the things they should be compared with.

1. Blocking time of an async local-tier save vs a synchronous one of the same state
   (target: async / sync <= 0.2): training should wait only for the snapshot.
2. Blocking time of both tiers vs Orbax's own async save (a plain `CheckpointManager`,
   async, same state, same run; target: spmd / Orbax <= 1.0 for the local tier).
3. Persistent-tier write throughput (Orbax save + our fsync + checksum manifest, i.e. until
   the step is committed) vs a raw sequential write + fsync of the same number of bytes to
   the same directory (target: >= 0.7), and vs Orbax's own write of the same state (a plain
   `CheckpointManager`, save + wait_until_finished, nothing else; target: >= 1.0).
   Where the persistent tier's time goes is reported per phase (`persistent_phases`).
4. Restore from the persistent tier (spmd's whole restore: planning, manifest check, the
   read with every chunk's crc32c checked) vs Orbax's own restore of its step vs a raw read of
   the same bytes (target: spmd / Orbax restore throughput >= 1.0); where spmd's restore time
   goes is reported per phase (`restore_phases`: plan_s, check_s, orbax_s = the read and the
   placement on the devices, after_s = the checkpointer's bookkeeping after it, from the
   `restore_timing` event). Every restore reads cold:
   the step's files are flushed and dropped from the page cache first (posix_fadvise), as
   after a restart on another node. `--restore-pairs` (3) pairs per repetition, which of
   the two goes first alternating, each with a raw read after it.
5. `--train-steps N`: training throughput with checkpoints every `--every` steps vs
   checkpoints off (target >= 0.95 when every x step time >= the background write time),
   and with Orbax's own async save at the same steps, in rotating windows of N steps.
   `--model 760m` (any size of benchmarks/gpu_mfu.py's ladder) trains the real transformer.

Repetitions are interleaved (async, sync, persistent, Orbax, raw, then again), a warm-up round
is not counted, and medians with min-max spread are reported. The three writes compared in 3
(the persistent tier's, Orbax's own, the raw write) rotate from one repetition to the next,
each first, second and third in turn, as the two restores of a pair alternate in 4, so that
none always pays for what came before it (the previous repetition's reads, memory freed,
the disk's writeback). One process; on CPU the "device" is host
memory, so the D2H copy is a memcpy.

    python benchmarks/checkpoint_bench.py [--mb 256 | --gb 9] [--reps 5] [--restore-pairs 3]
        [--dir DIR]
        [--snapshot auto|alias|host|pinned|device] [--compress] [--train-steps 40 --every 10]
        [--train-reps 3] [--model synthetic|tiny|760m]
    python benchmarks/checkpoint_bench.py --short      # CI: small state, never fails

Prints a table, a PASS/FAIL line (full mode; exit 1 on FAIL) and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from common import Stats, add_record_option, emit, machine, paired_ratios, table, versions  # noqa: E402

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
BLOCKING_TARGET = 0.2       # async blocking / sync blocking
ORBAX_TARGET = 1.0          # spmd local-tier blocking / Orbax async-save blocking
TRAIN_TARGET = 0.95         # steps/s with checkpoints / steps/s without
THROUGHPUT_TARGET = 0.7     # persistent-tier bytes/s / raw write+fsync bytes/s
ORBAX_WRITE_TARGET = 1.0    # persistent-tier bytes/s / Orbax's own write bytes/s
RESTORE_TARGET = 1.0        # spmd persistent restore bytes/s / Orbax restore bytes/s
# the order of the three compared writes, repetition by repetition (each first once in three)
WRITE_ORDERS = (("persistent", "orbax", "raw"), ("orbax", "raw", "persistent"),
                ("raw", "persistent", "orbax"))


def make_state(total_mb: int):
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    devices = np.array(jax.devices())
    mesh = jax.sharding.Mesh(devices, ("data",))
    n = len(devices)
    arrays = 4
    rows = max(n, (total_mb << 20) // arrays // 4 // 1024 // n * n)
    state = {"step": jax.device_put(np.int32(0), NamedSharding(mesh, P()))}
    rng = np.random.default_rng(0)
    for i in range(arrays):
        host = rng.standard_normal((rows, 1024), dtype=np.float32)
        state[f"w{i}"] = jax.device_put(host, NamedSharding(mesh, P("data")))
    nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
    return state, nbytes, f"{len(devices)} {devices[0].platform} device(s)"


class Events:
    """Keeps the checkpointer's events (the persistent tier reports its phases there)."""

    def __init__(self):
        self.records: list[dict] = []

    def emit(self, event: str, **fields) -> None:
        self.records.append({"event": event, **fields})


def checkpointer(root: Path, events: Events | None = None, **ck):
    from spmd.checkpoint import create_checkpointer
    from spmd.config.load import config_from_dict

    cfg = config_from_dict({"run": {"dir": str(root)}, "checkpoint": {"keep": 1, **ck}})
    env = SimpleNamespace(rank=0, size=1, node_of_rank=(0,), num_nodes=1)
    return create_checkpointer(cfg.checkpoint, run_dir=cfg.run.dir, env=env, events=events)


class OrbaxAsync:
    """Orbax's own async save, as a user of Orbax alone would write it (no compression,
    like the persistent tier's default), to compare blocking times with."""

    def __init__(self, root: Path):
        import orbax.checkpoint as ocp

        self.ocp = ocp
        self.manager = ocp.CheckpointManager(
            root, options=ocp.CheckpointManagerOptions(enable_async_checkpointing=True,
                                                       max_to_keep=1, create=True),
            item_handlers=ocp.PyTreeCheckpointHandler(use_compression=False))

    def save(self, step: int, state) -> float:
        t0 = time.perf_counter()
        self.manager.save(step, args=self.ocp.args.PyTreeSave(state), force=True)
        return time.perf_counter() - t0

    def restore(self, step: int, abstract):
        ocp = self.ocp
        return self.manager.restore(step, args=ocp.args.PyTreeRestore(
            item=abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract)))

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()


def raw_write(path: Path, nbytes: int, block: bytes) -> float:
    """Seconds to write `nbytes` sequentially and fsync them (the file stays, for raw_read)."""
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            n = min(left, len(block))
            f.write(block[:n] if n < len(block) else block)
            left -= n
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t0


def raw_read(path: Path, block: int = 32 << 20) -> float:
    """Seconds to read `path` sequentially, cold (its pages dropped first), into a buffer."""
    evict(path)
    buf = bytearray(block)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    return time.perf_counter() - t0


def timed_orbax_write(orbax: OrbaxAsync, step: int, state) -> float:
    """Seconds of Orbax's own write of `state` (fresh arrays) as step `step`: save and
    wait_until_finished, nothing in between; no dirty pages before or after it."""
    fresh = _bump(state)      # Orbax gets fresh arrays (np.asarray caches host copies)
    jax_block(fresh)
    os.sync()
    began = time.perf_counter()
    orbax.save(step, fresh)
    orbax.wait()
    took = time.perf_counter() - began
    os.sync()
    return took


def cold_spmd_restore(ck, root: Path, step: int, abstract, events: Events
                      ) -> tuple[float, dict]:
    """Seconds of spmd's whole restore of persistent step `step` read cold, and its
    `restore_timing` event (the phases)."""
    evict(root / "checkpoints" / str(step))
    began = time.perf_counter()
    got = ck.restore(abstract)
    jax_block(got.state)
    took = time.perf_counter() - began
    assert (got.step, got.source) == (step, "persistent"), (got.step, got.source)
    return took, [e for e in events.records if e["event"] == "restore_timing"][-1]


def cold_orbax_restore(orbax: OrbaxAsync, root: Path, step: int, abstract) -> float:
    """Seconds of Orbax's own restore of its step `step`, read cold."""
    evict(root / str(step))
    began = time.perf_counter()
    jax_block(orbax.restore(step, abstract))
    return time.perf_counter() - began


def evict(root: Path) -> None:
    """Drop the (clean, fsynced) pages of the files under `root` from the page cache, so that
    the next read comes from the disk, as after a restart."""
    for p in [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()]:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=256, help="state size in MiB (default 256)")
    ap.add_argument("--gb", type=float, default=None,
                    help="state size in GiB (overrides --mb; >= 8 for the GPU figure)")
    ap.add_argument("--snapshot", default="auto",
                    choices=("auto", "alias", "host", "pinned", "device"),
                    help="checkpoint.snapshot for the spmd checkpointers (default auto)")
    ap.add_argument("--train-steps", type=int, default=0,
                    help="also measure training throughput over this many steps, "
                         "checkpoints on vs off (0: skip)")
    ap.add_argument("--every", type=int, default=10,
                    help="checkpoint.every for the throughput measurement (default 10)")
    ap.add_argument("--train-reps", type=int, default=3,
                    help="alternating off/on windows of --train-steps each (default 3)")
    ap.add_argument("--model", default=None,
                    help="what trains in the throughput measurement: 'synthetic' (the state "
                         "above, one elementwise donating step; default) or a transformer of "
                         "benchmarks/gpu_mfu.py's ladder (e.g. 760m; 'tiny', the --short "
                         "default, on CPU)")
    ap.add_argument("--reps", type=int, default=5, help="measured repetitions (default 5)")
    ap.add_argument("--restore-pairs", type=int, default=3,
                    help="cold restore pairs (spmd's, Orbax's, alternating which goes first) "
                         "per repetition (default 3): a restore takes a fraction of a second "
                         "and single pairs swing with the disk")
    ap.add_argument("--dir", type=Path, default=None,
                    help="where to write (default: a temp dir under the current directory)")
    ap.add_argument("--short", action="store_true", help="CI mode: 16 MiB, 2 repetitions")
    ap.add_argument("--compress", action="store_true",
                    help="persistent tier with zstd (checkpoint.compress=true)")
    add_record_option(ap)
    args = ap.parse_args(argv)
    if args.short:
        args.mb, args.reps, args.restore_pairs = 16, 2, 1
        args.train_steps = args.train_steps or 12
        args.every = 4
        args.train_reps = min(args.train_reps, 2)
        args.model = args.model or "tiny"
    args.model = args.model or "synthetic"
    if args.train_steps and (args.train_steps < 2 * args.every
                             or args.train_steps % args.every):
        ap.error(f"--train-steps {args.train_steps} must be a multiple of --every "
                 f"({args.every}), at least 2 x: a window saves every --every steps but its "
                 "last, so that each save's background write falls inside the window")
    if args.gb is not None:
        args.mb = int(args.gb * 1024)
    if args.dir is not None:
        try:
            Path(args.dir).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            ap.error(f"--dir {args.dir}: cannot create it ({e.strerror})")
    base = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir or Path.cwd()))
    try:
        return run(args, base)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def run(args: argparse.Namespace, base: Path) -> int:
    import numpy as np

    state, nbytes, where = make_state(args.mb)
    block = np.random.default_rng(1).integers(0, 255, 32 << 20, dtype=np.uint8).tobytes()
    snap = {"snapshot": args.snapshot}
    ck_async = checkpointer(base / "async", every=1, persistent_every=0, **snap,
                            **{"async": True})
    ck_sync = checkpointer(base / "sync", every=1, persistent_every=0, **snap, **{"async": False})
    pers_events = Events()
    ck_pers = checkpointer(base / "pers", pers_events, every=0, persistent_every=1,
                           compress=args.compress, **snap, **{"async": True})
    abstract = _abstract(state)
    for ck in (ck_async, ck_sync, ck_pers):   # start-up: layout, buffers (as in training)
        ck.restore(abstract)
    orbax = OrbaxAsync(base / "orbax")
    orbax_write = OrbaxAsync(base / "orbax-write")   # save + wait, nothing in between
    results: dict[str, list[float]] = {k: [] for k in (
        "async_blocking_s", "async_total_s", "sync_blocking_s", "persistent_blocking_s",
        "persistent_total_s", "persistent_orbax_s", "persistent_bytes", "raw_s",
        "orbax_blocking_s", "orbax_total_s", "async_next_step_s", "orbax_next_step_s",
        "plain_step_s", "orbax_write_s", "persistent_restore_s", "orbax_restore_s",
        "raw_read_s")}
    phases: dict[str, list[float]] = {}
    restore_phases: dict[str, list[float]] = {}   # spmd's restore, from restore_timing
    step, pers_bytes = 0, 0
    for rep in range(args.reps + 1):     # round 0 warms up (compiles, Orbax start-up)
        step += 1
        os.sync()   # every timed phase starts with no dirty pages of the previous one
        state = _donating(state)       # a step with nothing saved, for the next-step cost
        jax_block(state)
        tp = time.perf_counter()
        state = _donating(state)
        jax_block(state)
        plain_step = time.perf_counter() - tp
        t0 = time.perf_counter()
        ck_async.maybe_save(step, state)
        t1 = time.perf_counter()
        state = _donating(state)       # the trainer's next (donating) step, while it writes
        jax_block(state)
        async_next = time.perf_counter() - t1
        ck_async.wait()
        t2 = time.perf_counter()
        os.sync()
        t2 = time.perf_counter()
        ck_sync.maybe_save(step, state)
        t3 = time.perf_counter()
        # the three writes compared (the persistent tier's, Orbax's own, the raw write of the
        # tier's bytes) rotate: each goes first, second and third in turn, after an os.sync()
        order = WRITE_ORDERS[rep % len(WRITE_ORDERS)]
        for which in order:
            os.sync()
            if which == "orbax":
                orbax_write_s = timed_orbax_write(orbax_write, step, state)
            elif which == "raw":
                # the bytes the tier wrote (its previous step's when the raw write goes first)
                raw = raw_write(base / "raw.bin", pers_bytes or nbytes, block)
            else:
                p0 = time.perf_counter()
                ck_pers.maybe_save(step, state)
                p1 = time.perf_counter()
                ck_pers.wait()
                p2 = time.perf_counter()
                # the step it dropped is removed in the background (in training, while the
                # next steps run): gone before the next write is timed, as Orbax's own is
                ck_pers.persistent.wait_removals()
        pers_bytes = sum(p.stat().st_size for p in (base / "pers" / "checkpoints" / str(step))
                         .rglob("*") if p.is_file())
        os.sync()
        fresh = _bump(state)      # Orbax gets fresh arrays (np.asarray caches host copies)
        jax_block(fresh)
        t6 = time.perf_counter()
        orbax_blocking = orbax.save(step, fresh)
        tn = time.perf_counter()
        fresh = _donating(fresh)
        jax_block(fresh)
        orbax_next = time.perf_counter() - tn
        orbax.wait()
        orbax_total = time.perf_counter() - t6
        del fresh
        # restores, cold: spmd's whole restore of the persistent step, Orbax's own, raw read;
        # --restore-pairs of them, which one goes first alternating from pair to pair
        restores = []
        for pair in range(args.restore_pairs):
            spmd_first = (rep + pair) % 2 == 0
            if spmd_first:
                pers_restore, timing = cold_spmd_restore(ck_pers, base / "pers", step,
                                                         abstract, pers_events)
            orbax_restore = cold_orbax_restore(orbax_write, base / "orbax-write", step,
                                               abstract)
            if not spmd_first:
                pers_restore, timing = cold_spmd_restore(ck_pers, base / "pers", step,
                                                         abstract, pers_events)
            restores.append((pers_restore, timing, orbax_restore, raw_read(base / "raw.bin")))
        (base / "raw.bin").unlink()
        saved = [e for e in pers_events.records if e["event"] == "saved" and e["step"] == step]
        # from the start of Orbax's save (in our background thread) until it finished
        orbax_write_in_tier = saved[-1]["orbax_start_s"] + saved[-1]["orbax_wait_s"]
        if rep == 0:
            continue
        for key in ("orbax_start_s", "orbax_wait_s", "checksum_fsync_s", "commit_s", "drop_s",
                    "chunk_crc_s"):   # chunk_crc_s: the chunks' crc32c, during orbax_wait_s
            phases.setdefault(key, []).append(saved[-1].get(key, 0.0))
        phases.setdefault("other_s", []).append(
            (p2 - p0) - sum(saved[-1].get(k, 0.0) for k in (
                "orbax_start_s", "orbax_wait_s", "checksum_fsync_s", "commit_s", "drop_s")))
        for pers_restore, timing, orbax_restore, read in restores:
            for key in ("plan_s", "check_s", "orbax_s"):
                restore_phases.setdefault(key, []).append(timing.get(key, 0.0))
            # the rest of the checkpointer's restore: its bookkeeping after the read
            restore_phases.setdefault("after_s", []).append(pers_restore - timing["total_s"])
            results["persistent_restore_s"].append(pers_restore)
            results["orbax_restore_s"].append(orbax_restore)
            results["raw_read_s"].append(read)
        results["orbax_write_s"].append(orbax_write_s)
        results["persistent_orbax_s"].append(orbax_write_in_tier)
        results["orbax_blocking_s"].append(orbax_blocking)
        results["orbax_total_s"].append(orbax_total)
        results["async_next_step_s"].append(async_next)
        results["orbax_next_step_s"].append(orbax_next)
        results["plain_step_s"].append(plain_step)
        for k, v in (("async_blocking_s", t1 - t0), ("async_total_s", t2 - t0),
                     ("sync_blocking_s", t3 - t2), ("persistent_blocking_s", p1 - p0),
                     ("persistent_total_s", p2 - p0), ("persistent_bytes", pers_bytes),
                     ("raw_s", raw)):
            results[k].append(v)
    for ck in (ck_async, ck_sync, ck_pers):
        ck.close()
    orbax.close()
    orbax_write.close()
    snapshot_mode = ck_async.snapshotter.mode
    train = train_throughput(args, base, state) if args.train_steps else None

    def stats(values: list[float]) -> dict:
        return Stats.of(values).as_dict(4)

    ratio_blocking = paired_ratios(results["async_blocking_s"], results["sync_blocking_s"])
    ratio_tput = paired_ratios(results["raw_s"], results["persistent_total_s"])
    ratio_orbax = paired_ratios(results["raw_s"], results["persistent_orbax_s"])
    ratio_vs_orbax_write = paired_ratios(results["orbax_write_s"], results["persistent_total_s"])
    ratio_orbax_own = paired_ratios(results["raw_s"], results["orbax_write_s"])
    ratio_restore = paired_ratios(results["orbax_restore_s"], results["persistent_restore_s"])
    ratio_restore_raw = paired_ratios(results["raw_read_s"], results["persistent_restore_s"])
    ratio_orbax_restore_raw = paired_ratios(results["raw_read_s"], results["orbax_restore_s"])
    ratio_local_orbax = paired_ratios(results["async_blocking_s"], results["orbax_blocking_s"])
    # what a save costs the step loop in all: blocking plus the next step's extra time
    # (zero-copy views make the next donating step allocate fresh buffers)
    cost_local = [b + n - p for b, n, p in zip(results["async_blocking_s"],
                                               results["async_next_step_s"],
                                               results["plain_step_s"])]
    cost_orbax = [b + n - p for b, n, p in zip(results["orbax_blocking_s"],
                                               results["orbax_next_step_s"],
                                               results["plain_step_s"])]
    ratio_cost = paired_ratios(cost_local, cost_orbax)
    ratio_pers_orbax = paired_ratios(results["persistent_blocking_s"],
                                     results["orbax_blocking_s"])
    nb = statistics.median(results["persistent_bytes"])
    blocking, tput = statistics.median(ratio_blocking), statistics.median(ratio_tput)
    vs_orbax = statistics.median(ratio_local_orbax)
    vs_orbax_write = statistics.median(ratio_vs_orbax_write)
    restore = statistics.median(ratio_restore)
    verdict = None
    if not args.short:
        ok = (blocking <= BLOCKING_TARGET and tput >= THROUGHPUT_TARGET
              and vs_orbax <= ORBAX_TARGET and vs_orbax_write >= ORBAX_WRITE_TARGET
              and restore >= RESTORE_TARGET
              and (train is None or train["ratio"] >= TRAIN_TARGET or not train["write_fits"]))
        verdict = "PASS" if ok else "FAIL"
    record = {
        "benchmark": "checkpoint", "mode": "short" if args.short else "full",
        "verdict": verdict, "machine": machine(), "state_bytes": nbytes, "devices": where,
        "reps": args.reps, "restore_pairs": args.restore_pairs, "dir": str(base.parent),
        "compress": args.compress,
        "snapshot": snapshot_mode, "versions": versions(),
        "async_blocking_s": stats(results["async_blocking_s"]),
        "sync_blocking_s": stats(results["sync_blocking_s"]),
        "async_total_s": stats(results["async_total_s"]),
        "blocking_ratio_async_over_sync": {**stats(ratio_blocking),
                                           "target": f"<= {BLOCKING_TARGET}"},
        "persistent_blocking_s": stats(results["persistent_blocking_s"]),
        "persistent_MBps": round(nb / statistics.median(results["persistent_total_s"]) / 1e6, 1),
        "orbax_write_MBps": round(nb / statistics.median(results["persistent_orbax_s"]) / 1e6, 1),
        "raw_MBps": round(nb / statistics.median(results["raw_s"]) / 1e6, 1),
        "throughput_ratio_persistent_over_raw": {**stats(ratio_tput),
                                                 "target": f">= {THROUGHPUT_TARGET}"},
        "throughput_ratio_orbax_write_over_raw": stats(ratio_orbax),
        "orbax_own_write_s": stats(results["orbax_write_s"]),
        "orbax_own_write_MBps": round(nb / statistics.median(results["orbax_write_s"]) / 1e6,
                                      1),
        "throughput_ratio_persistent_over_orbax_write": {
            **stats(ratio_vs_orbax_write), "target": f">= {ORBAX_WRITE_TARGET}"},
        "throughput_ratio_orbax_own_write_over_raw": stats(ratio_orbax_own),
        "persistent_phases": {k: stats(v) for k, v in phases.items()},
        "persistent_restore_s": stats(results["persistent_restore_s"]),
        "restore_phases": {k: stats(v) for k, v in restore_phases.items()},
        "orbax_restore_s": stats(results["orbax_restore_s"]),
        "raw_read_s": stats(results["raw_read_s"]),
        "restore_MBps": {k: round(nb / statistics.median(results[f"{k}_s"]) / 1e6, 1)
                         for k in ("persistent_restore", "orbax_restore", "raw_read")},
        "restore_ratio_persistent_over_orbax": {**stats(ratio_restore),
                                                "target": f">= {RESTORE_TARGET}"},
        "restore_ratio_persistent_over_raw": stats(ratio_restore_raw),
        "restore_ratio_orbax_over_raw": stats(ratio_orbax_restore_raw),
        "orbax_async_blocking_s": stats(results["orbax_blocking_s"]),
        "orbax_async_total_s": stats(results["orbax_total_s"]),
        "blocking_ratio_local_over_orbax": {**stats(ratio_local_orbax),
                                            "target": f"<= {ORBAX_TARGET}"},
        "blocking_ratio_persistent_over_orbax": stats(ratio_pers_orbax),
        "plain_step_s": stats(results["plain_step_s"]),
        "async_next_step_s": stats(results["async_next_step_s"]),
        "orbax_next_step_s": stats(results["orbax_next_step_s"]),
        "save_cost_local_s": stats(cost_local),
        "save_cost_orbax_s": stats(cost_orbax),
        "save_cost_ratio_local_over_orbax": stats(ratio_cost),
        "train": train,
    }
    rows = [("measure", "median", "[min, max]", "target")]
    for key in ("async_blocking_s", "sync_blocking_s", "async_total_s",
                "persistent_blocking_s", "orbax_async_blocking_s", "orbax_async_total_s",
                "blocking_ratio_async_over_sync", "blocking_ratio_local_over_orbax",
                "blocking_ratio_persistent_over_orbax", "plain_step_s", "async_next_step_s",
                "orbax_next_step_s", "save_cost_local_s", "save_cost_orbax_s",
                "save_cost_ratio_local_over_orbax", "throughput_ratio_persistent_over_raw",
                "throughput_ratio_orbax_write_over_raw", "orbax_own_write_s",
                "throughput_ratio_persistent_over_orbax_write",
                "throughput_ratio_orbax_own_write_over_raw", "persistent_restore_s",
                "orbax_restore_s", "raw_read_s", "restore_ratio_persistent_over_orbax",
                "restore_ratio_persistent_over_raw", "restore_ratio_orbax_over_raw"):
        r = record[key]
        rows.append((key, f"{r['median']:.4f}", f"[{r['min']:.4f}, {r['max']:.4f}]",
                     r.get("target", "")))
    for key, r in record["persistent_phases"].items():
        rows.append((f"persistent phase {key}", f"{r['median']:.4f}",
                     f"[{r['min']:.4f}, {r['max']:.4f}]", ""))
    for key, r in record["restore_phases"].items():
        rows.append((f"restore phase {key}", f"{r['median']:.4f}",
                     f"[{r['min']:.4f}, {r['max']:.4f}]", ""))
    for key in ("persistent_MBps", "orbax_write_MBps", "orbax_own_write_MBps", "raw_MBps"):
        rows.append((key, f"{record[key]:.1f}", "", ""))
    for key, value in record["restore_MBps"].items():
        rows.append((f"{key}_MBps", f"{value:.1f}", "", ""))
    print(f"checkpoint benchmark ({record['mode']}): state {nbytes / 2**20:.0f} MiB on {where}, "
          f"{args.reps} interleaved reps after a warm-up, writing under {base.parent}")
    print(table(rows))
    if verdict is None:
        print("short mode: timings are a smoke test, no target is checked")
    else:
        print(f"{verdict}: blocking ratio {blocking:.3f} (target <= {BLOCKING_TARGET}), "
              f"local/Orbax blocking {vs_orbax:.3f} (target <= {ORBAX_TARGET}), "
              f"persistent/raw throughput {tput:.3f} (target >= {THROUGHPUT_TARGET}), "
              f"persistent/Orbax write throughput {vs_orbax_write:.3f} (target >= "
              f"{ORBAX_WRITE_TARGET}), persistent/Orbax restore throughput {restore:.3f} "
              f"(target >= {RESTORE_TARGET})")
    if train is not None:
        print(f"training throughput ({train['model']}) with checkpoints every {train['every']} "
              f"steps / without: {train['ratio']:.3f}, with Orbax's async save instead: "
              f"{train['ratio_orbax']:.3f} (target >= {TRAIN_TARGET} when every x step "
              f"{train['every'] * train['step_s_off']:.3f} s >= background write "
              f"{train['write_s']:.3f} s: {'yes' if train['write_fits'] else 'no'}); "
              f"blocked fraction {train['blocked_fraction']:.4f} (blocking "
              f"{train['blocking_s']:.3f} s + waiting {train['waited_s']:.3f} s of "
              f"{train['wall_s']:.1f} s since the checkpointer started)")
    emit(record, args)
    return 1 if verdict == "FAIL" else 0


def _abstract(tree):
    import jax

    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        tree)


def _bump(tree):
    import jax

    return jax.tree.map(lambda x: x + 0, tree)


@functools.cache
def _donating_step():
    import jax

    return jax.jit(lambda t: jax.tree.map(lambda x: x + 1, t), donate_argnums=0)


def _donating(tree):
    """One donating step, as the trainer's: every leaf's buffer is rewritten in place."""
    return _donating_step()(tree)


def jax_block(tree) -> None:
    import jax

    jax.block_until_ready(tree)




def train_throughput(args: argparse.Namespace, base: Path, synthetic) -> dict:
    """Steps/s of a donating train step, checkpoints (both tiers' schedule) on vs off."""
    import jax

    if args.model != "synthetic":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from gpu_mfu import compile_size, size_overrides

        overrides = size_overrides(args.model, None, None)
        rt, compiled, _, _ = compile_size(args.model, overrides, jax.devices()[0], None, 0.9)
        state = rt.init()
        batch = rt.feed.global_batch(rt.task.train_source(), 0)

        def step_fn(s):
            return compiled(s, batch)[0]
    else:
        state = jax.tree.map(lambda x: x + 0, synthetic)
        compiled = jax.jit(lambda s: jax.tree.map(lambda x: x * 0.999 + 0.001 if
                                                  x.dtype.kind == "f" else x + 1, s),
                           donate_argnums=0)

        def step_fn(s):
            return compiled(s)

    n, every = args.train_steps, args.every
    for _ in range(2):
        state = step_fn(state)
    jax.block_until_ready(state)
    events = Events()
    ck = checkpointer(base / "train", events, every=every, persistent_every=0,
                      snapshot=args.snapshot, **{"async": True})
    ck.restore(_abstract(state))
    orbax = OrbaxAsync(base / "train-orbax")
    # Steady state: a window of n steps with checkpoints holds the saves at every, 2 every,
    # ..., n - every, so the background write of each save falls inside it and none spills
    # into the next window (which waits for it untimed). Windows rotate off / spmd / Orbax's
    # own async save of the same state; the best of each counts.
    times: dict[str, list[float]] = {"off": [], "on": [], "orbax": []}
    for rep in range(args.train_reps):
        for label in times:
            t0 = time.perf_counter()
            for i in range(1, n + 1):
                state = step_fn(state)
                if i % every or i > n - every:
                    continue
                if label == "on":
                    ck.maybe_save(rep * n + i, state)
                elif label == "orbax":
                    orbax.save(rep * n + i, state)
            jax.block_until_ready(state)
            times[label].append(time.perf_counter() - t0)
            ck.wait()
            orbax.wait()
    ck.close()
    orbax.close()
    saved = [e for e in events.records if e["event"] == "saved"]
    (summary,) = [e for e in events.records if e["event"] == "checkpoint_summary"]
    off, on, with_orbax = min(times["off"]), min(times["on"]), min(times["orbax"])
    write_s = statistics.median(e["seconds"] for e in saved) if saved else 0.0
    return {"model": args.model, "steps": n, "every": every,
            "step_s_off": round(off / n, 5), "step_s_on": round(on / n, 5),
            "ratio": round(off / on, 4), "ratio_orbax": round(off / with_orbax, 4),
            "write_s": round(write_s, 4),
            "write_fits": every * off / n >= write_s, "saves": len(saved),
            "reps": args.train_reps, "off_s": [round(t, 4) for t in times["off"]],
            "on_s": [round(t, 4) for t in times["on"]],
            "orbax_s": [round(t, 4) for t in times["orbax"]],
            "blocked_fraction": summary["blocked_fraction"], "wall_s": summary["wall_s"],
            "blocking_s": summary["blocking_s"], "waited_s": summary["waited_s"]}


if __name__ == "__main__":
    sys.exit(main())
