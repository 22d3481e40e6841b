"""Checkpoint costs, measured against the two things they should be compared with.

1. Blocking time of an async local-tier save vs a synchronous one of the same state
   (target: async / sync <= 0.2): training should wait only for the device-to-host copy.
2. Persistent-tier write throughput (Orbax save + our fsync + checksum manifest, i.e. until
   the step is committed) vs a raw sequential write + fsync of the same number of bytes to
   the same directory (target: >= 0.7).

Repetitions are interleaved (async, sync, persistent, raw, then again), a warm-up round is
not counted, and medians with min-max spread are reported. One process; on CPU the "device"
is host memory, so the D2H copy is a memcpy.

    python benchmarks/checkpoint_bench.py [--mb 256] [--reps 5] [--dir DIR] [--compress]
    python benchmarks/checkpoint_bench.py --short      # CI: small state, never fails

Prints a table, a PASS/FAIL line (full mode; exit 1 on FAIL) and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from common import Stats, json_line, machine, paired_ratios, table  # noqa: E402

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
BLOCKING_TARGET = 0.2       # async blocking / sync blocking
THROUGHPUT_TARGET = 0.7     # persistent-tier bytes/s / raw write+fsync bytes/s


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
    from spmd.checkpoint import make_checkpointer
    from spmd.config import config_from_dict

    cfg = config_from_dict({"run": {"dir": str(root)}, "checkpoint": {"keep": 1, **ck}})
    env = SimpleNamespace(rank=0, size=1, node_of_rank=(0,), num_nodes=1)
    return make_checkpointer(cfg, env, events)


def raw_write(path: Path, nbytes: int, block: bytes) -> float:
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            n = min(left, len(block))
            f.write(block[:n] if n < len(block) else block)
            left -= n
        f.flush()
        os.fsync(f.fileno())
    dt = time.perf_counter() - t0
    path.unlink()
    return dt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=256, help="state size in MiB (default 256)")
    ap.add_argument("--reps", type=int, default=5, help="measured repetitions (default 5)")
    ap.add_argument("--dir", type=Path, default=None,
                    help="where to write (default: a temp dir under the current directory)")
    ap.add_argument("--short", action="store_true", help="CI mode: 16 MiB, 2 repetitions")
    ap.add_argument("--compress", action="store_true",
                    help="persistent tier with zstd (checkpoint.compress=true)")
    args = ap.parse_args(argv)
    if args.short:
        args.mb, args.reps = 16, 2
    base = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir or Path.cwd()))
    try:
        return run(args, base)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def run(args: argparse.Namespace, base: Path) -> int:
    import numpy as np

    state, nbytes, where = make_state(args.mb)
    block = np.random.default_rng(1).integers(0, 255, 32 << 20, dtype=np.uint8).tobytes()
    ck_async = checkpointer(base / "async", every=1, persistent_every=0, **{"async": True})
    ck_sync = checkpointer(base / "sync", every=1, persistent_every=0, **{"async": False})
    pers_events = Events()
    ck_pers = checkpointer(base / "pers", pers_events, every=0, persistent_every=1,
                           compress=args.compress, **{"async": True})
    results: dict[str, list[float]] = {k: [] for k in (
        "async_blocking_s", "async_total_s", "sync_blocking_s", "persistent_blocking_s",
        "persistent_total_s", "persistent_orbax_s", "persistent_bytes", "raw_s")}
    step = 0
    for rep in range(args.reps + 1):     # round 0 warms up (compiles, Orbax start-up)
        step += 1
        os.sync()   # every timed phase starts with no dirty pages of the previous one
        t0 = time.perf_counter()
        ck_async.maybe_save(step, state)
        t1 = time.perf_counter()
        ck_async.wait()
        t2 = time.perf_counter()
        os.sync()
        t2 = time.perf_counter()
        ck_sync.maybe_save(step, state)
        t3 = time.perf_counter()
        os.sync()
        t3 = time.perf_counter()
        ck_pers.maybe_save(step, state)
        t4 = time.perf_counter()
        ck_pers.wait()
        t5 = time.perf_counter()
        pers_bytes = sum(p.stat().st_size for p in (base / "pers" / "checkpoints" / str(step))
                         .rglob("*") if p.is_file())
        os.sync()
        raw = raw_write(base / "raw.bin", pers_bytes, block)
        saved = [e for e in pers_events.records if e["event"] == "saved" and e["step"] == step]
        orbax = (t4 - t3) + saved[-1]["orbax_wait_s"]   # from save() until Orbax finished
        if rep == 0:
            continue
        results["persistent_orbax_s"].append(orbax)
        for k, v in (("async_blocking_s", t1 - t0), ("async_total_s", t2 - t0),
                     ("sync_blocking_s", t3 - t2), ("persistent_blocking_s", t4 - t3),
                     ("persistent_total_s", t5 - t3), ("persistent_bytes", pers_bytes),
                     ("raw_s", raw)):
            results[k].append(v)
    for ck in (ck_async, ck_sync, ck_pers):
        ck.close()

    def stats(values: list[float]) -> dict:
        return Stats.of(values).as_dict(4)

    ratio_blocking = paired_ratios(results["async_blocking_s"], results["sync_blocking_s"])
    ratio_tput = paired_ratios(results["raw_s"], results["persistent_total_s"])
    ratio_orbax = paired_ratios(results["raw_s"], results["persistent_orbax_s"])
    nb = statistics.median(results["persistent_bytes"])
    blocking, tput = statistics.median(ratio_blocking), statistics.median(ratio_tput)
    verdict = None
    if not args.short:
        verdict = "PASS" if blocking <= BLOCKING_TARGET and tput >= THROUGHPUT_TARGET else "FAIL"
    record = {
        "benchmark": "checkpoint", "mode": "short" if args.short else "full",
        "verdict": verdict, "machine": machine(), "state_bytes": nbytes, "devices": where,
        "reps": args.reps, "dir": str(base.parent), "compress": args.compress,
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
    }
    rows = [("measure", "median", "[min, max]", "target")]
    for key in ("async_blocking_s", "sync_blocking_s", "async_total_s",
                "persistent_blocking_s", "blocking_ratio_async_over_sync",
                "throughput_ratio_persistent_over_raw", "throughput_ratio_orbax_write_over_raw"):
        r = record[key]
        rows.append((key, f"{r['median']:.4f}", f"[{r['min']:.4f}, {r['max']:.4f}]",
                     r.get("target", "")))
    for key in ("persistent_MBps", "orbax_write_MBps", "raw_MBps"):
        rows.append((key, f"{record[key]:.1f}", "", ""))
    print(f"checkpoint benchmark ({record['mode']}): state {nbytes / 2**20:.0f} MiB on {where}, "
          f"{args.reps} interleaved reps after a warm-up, writing under {base.parent}")
    print(table(rows))
    if verdict is None:
        print("short mode: timings are a smoke test, no target is checked")
    else:
        print(f"{verdict}: blocking ratio {blocking:.3f} (target <= {BLOCKING_TARGET}), "
              f"persistent/raw throughput {tput:.3f} (target >= {THROUGHPUT_TARGET})")
    print(json_line(record))
    return 1 if verdict == "FAIL" else 0


if __name__ == "__main__":
    sys.exit(main())
