"""The data feed against a raw read of the same files, and the input wait of training.

1. Feed vs raw read. A multi-file dataset (`--files` stores holding `train/u0`, `train/u1`
   of shape (n, grid, grid, 1) float32, `--mb` MiB in all, one example per chunk as
   `spmd.data.write_arrays` stores it) is written in each of `--formats`. Per format:
   - raw: every file read whole (`array[...]`, h5py or zarr), in file order, one thread;
   - feed: `ArraySource` (seeded shuffle, as training reads it) + `BatchFeed` on a
     1-process mesh, `data.prefetch` / `data.read_threads` defaults (2 / 1): every step of
     one epoch through `global_batch`, blocking on the arrays;
   - feed without prefetch (`data.prefetch: 0`, with `--prefetch` > 0): the same reads in
     the caller's thread, reported as no-prefetch / raw (with no step to overlap, as here,
     prefetch only adds the hand-off between threads);
   - shuffled (HDF5): every record in a seeded random order, one `os.preadv` each from
     16 threads, no other work: the I/O floor of any shuffled record read, reported as
     shuffled / raw and feed / shuffled;
   all with a cold page cache (`posix_fadvise(DONTNEED)` on every file of the dataset,
   every chunk file of a Zarr store, after an fsync at write time; the output says whether
   it was applied) and with a warm one. Reported: samples/s, MB/s and the paired ratio
   feed / raw of samples/s (target >= 0.8).
2. Input wait while training: `spmd train --config` (default examples/kolmogorov, else
   examples/vit2d) for `--train-steps` steps in a subprocess (1 process; every step logged,
   no eval, no periodic checkpoint), then from metrics.jsonl the input-wait fraction =
   sum(input_wait_s) / sum(step_time_s) over the steps after the first, the samples/s the
   step consumes, and the raw read samples/s of the same training data (bytes per sample:
   the bytes of the datasets the train source reads, over its samples). Target: fraction
   <= 2% whenever the raw read outruns consumption.

    python benchmarks/data_throughput.py [--mb 512] [--formats hdf5,zarr] [--reps 3]
        [--config CONFIG] [--train-steps 200] [--set KEY=VALUE ...] [--json FILE]
        [--profile]
    python benchmarks/data_throughput.py --quick     # CI: 16 MiB, 1 rep, never fails

3. Gridded weather files (issue 35; `--gridded`, default every layout): ERA5-like data
   written by xarray, 4 float32 variables (t2m, u10, v10, msl) on `--nlat` x `--nlon`,
   `--gridded-files` NetCDF4 files of `--gridded-steps` 6-hourly steps (one Zarr v3 store
   of every step for zarr_t4), in four layouts: nc_plain (contiguous), nc_zlib_default
   (zlib, netCDF's default chunks), nc_zlib_1xy (zlib, chunks 1 x lat x lon), zarr_t4
   (chunks of 4 steps). Per layout, paired and interleaved, cold then warm: spmd's feed
   (GriddedWindowSource of (t, t+1) windows, the variables as channels, seeded shuffle,
   through BatchFeed.global_batch, batch `--batch`) against a plain read of the same bytes
   (h5py / zarr, every variable in blocks of 256 time steps), the plain windows a
   hand-written NumPy loader cuts from those blocks, and the xarray loop a scientist writes
   (`.load()` the files, the same shuffled (t, t+1) windows in batches, `jax.device_put`);
   samples are windows. nc_packed adds the CDS's int16 packing (scale_factor, add_offset).
   Reported: samples/s, the ratios feed / plain, feed / plain windows (target >= 0.8) and
   feed / xarray loop (target >= 1.0), median [min, max], and whether `spmd data info`
   warns about the layout (a layout it warns about may stay below the targets).

`--profile` adds, per format, where a warm feed's time goes over its first 64 steps, in
microseconds per sample: the record index lookups, the single-record reads straight from
the store, `ArraySource.rows`, `global_batch` synchronous and with 1 and `--read-threads`
threads, the raw whole-file read; and cProfile's top own time of a synchronous epoch.

Invariants: raw and feed read the same records (one epoch, every record once) from the
same files; the repetitions alternate their order; the training run logs every step
(`run.log_every=1`: `input_wait_s` is the wait of the logged step only); everything is
written under one temporary directory (`--dir`), removed at exit. Prints tables, a
PASS/FAIL line (full mode; exit 1 on FAIL) and, last, one JSON line (`--json FILE`: also
written there).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import math
import os
import pstats
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))   # spmd, examples
from common import Stats, add_record_option, emit, machine, paired_ratios, table, versions  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
FEED_TARGET = 0.8           # feed samples/s / raw read samples/s (gridded: plain windows)
XARRAY_TARGET = 1.0         # gridded feed samples/s / the xarray loop's
WAIT_TARGET = 0.02          # sum(input_wait_s) / sum(step_time_s)
CONFIGS = (REPO / "examples" / "kolmogorov" / "config.yaml",
           REPO / "examples" / "vit2d" / "config.yaml")
SUFFIX = {"hdf5": ".h5", "zarr": ".zarr", "netcdf": ".nc"}
MB = 2**20
PROFILE_STEPS = 64          # steps of the --profile measurements
RANDOM_THREADS = 16         # threads of the shuffled-record floor (I/O in flight at once)


# ------------------------------------------------------------------ files and page cache


def files_of(path: Path) -> list[Path]:
    """Every regular file of a store or dataset directory (a Zarr store's chunk files too)."""
    path = Path(path)
    if path.is_file():
        return [path]
    return sorted(Path(root) / name for root, _, names in os.walk(path) for name in names)


def drop_cache(paths: list[Path]) -> bool:
    """Ask the kernel to drop the cached pages of `paths` (clean pages only: the files were
    fsynced). False when the platform or a file refuses."""
    if not hasattr(os, "posix_fadvise"):
        return False
    ok = True
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            ok = False
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            ok = False
        finally:
            os.close(fd)
    return ok


def fsync_all(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def make_dataset(root: Path, fmt: str, total_mb: float, files: int, grid: int,
                 seed: int = 0) -> tuple[Path, int]:
    """`files` stores of `fmt` under root/fmt holding train/u0, train/u1; (dir, records)."""
    import numpy as np

    from spmd.data import write_arrays

    per_record = 2 * grid * grid * 4
    per_file = max(1, int(total_mb * MB) // (files * per_record))
    out = root / fmt
    rng = np.random.default_rng(seed)
    for i in range(files):
        arrays = {f"train/{name}": rng.standard_normal((per_file, grid, grid, 1),
                                                       dtype=np.float32)
                  for name in ("u0", "u1")}
        write_arrays(out / f"part-{i:03d}{SUFFIX[fmt]}", arrays, format=fmt)
    fsync_all(files_of(out))
    return out, per_file * files


# ------------------------------------------------------------------ the two readers


def raw_read(members: list[tuple[Path, str]], datasets: list[str]) -> int:
    """Read `datasets` of every member whole, in order, in this thread; the bytes read."""
    import h5py
    import numpy as np

    nbytes = 0
    for path, fmt in members:
        if fmt in ("hdf5", "netcdf"):
            with h5py.File(path, "r") as f:
                for name in datasets:
                    nbytes += f[name][...].nbytes
        elif fmt == "zarr":
            import zarr

            group = zarr.open_group(str(path), mode="r")
            for name in datasets:
                nbytes += np.asarray(group[name][...]).nbytes
        else:   # npy
            for name in datasets:
                nbytes += np.array(np.load(path / f"{name}.npy", mmap_mode="r")).nbytes
    return nbytes


class ShuffledRecords:
    """The I/O floor of any shuffled record read (HDF5 / NetCDF4 with direct layouts):
    every record of `datasets`, in a seeded random order, one `os.preadv` each from
    RANDOM_THREADS threads, no other work. What the device gives for reads of one record
    each, against the large sequential reads of a whole-file read."""

    def __init__(self, members: list[tuple[Path, str]], datasets: list[str], seed: int):
        import h5py
        import numpy as np

        from spmd.data.formats.direct_reads import DirectLayout

        self.fds: list[int] = []
        jobs: list[tuple[int, int]] = []
        self.row_bytes = 0
        for path, _ in members:
            fd = os.open(path, os.O_RDONLY)
            self.fds.append(fd)
            with h5py.File(path, "r") as f:
                for name in datasets:
                    layout = DirectLayout.of(f[name], fd)
                    if layout is None:
                        raise ValueError(f"{path}:{name} has no direct layout")
                    self.row_bytes = layout.row_bytes
                    jobs += [(fd, layout.offset(r)) for r in range(f[name].shape[0])]
        order = np.random.default_rng(seed).permutation(len(jobs))
        self.jobs = [jobs[i] for i in order.tolist()]

    def __call__(self) -> int:
        """Read every record once; the bytes read."""
        from concurrent.futures import ThreadPoolExecutor

        import numpy as np

        def part(k: int) -> int:
            buffer = np.empty(self.row_bytes, np.uint8)
            return sum(os.preadv(fd, [buffer], off) for fd, off in self.jobs[k::RANDOM_THREADS])

        with ThreadPoolExecutor(RANDOM_THREADS) as pool:
            return sum(pool.map(part, range(RANDOM_THREADS)))

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)


def members_of(path: Path) -> list[tuple[Path, str]]:
    from spmd.data.formats.file_index import load_index

    return [(m.path, m.format) for m in load_index(path, f"data.path={path}").members]


class FeedEpoch:
    """`global_batch` for every step of one epoch (or its first `steps`), as training calls it."""

    def __init__(self, path: Path, grid: int, batch: int, seed: int, prefetch: int,
                 threads: int, steps: int | None = None, shuffle_block: int | str = "auto",
                 shuffle_mix: int = 16):
        import jax
        import numpy as np

        from spmd.config.schema import MeshConfig
        from spmd.data import BatchField
        from spmd.engine.mesh import build_mesh
        from spmd.sharding import rules_for

        self.path, self.batch, self.seed = path, batch, seed
        self.prefetch, self.threads, self.shuffle_block = prefetch, threads, shuffle_block
        self.shuffle_mix = shuffle_mix
        axes = ("batch", "x", "y", "channels")
        self.fields = {n: BatchField((grid, grid, 1), np.float32, axes) for n in ("u0", "u1")}
        self.mesh = build_mesh(MeshConfig(strategy="dp"), jax.devices())
        self.rules = rules_for("dp")
        epoch = self.source(None).count // batch
        self.steps = epoch if steps is None else min(steps, epoch)

    def source(self, until: int | None):
        from spmd.data import ArraySource

        return ArraySource(self.path, {"u0": "train/u0", "u1": "train/u1"}, self.fields,
                           self.batch, seed=self.seed, shuffle=True, prefetch=self.prefetch,
                           read_threads=self.threads, prefetch_until=until,
                           shuffle_block=self.shuffle_block, shuffle_mix=self.shuffle_mix)

    def __call__(self) -> dict:
        """Run the steps: samples, bytes read, the caller's total wait."""
        import jax

        from spmd.data.loader.feed import BatchFeed

        source = self.source(self.steps)
        feed = BatchFeed(self.fields, self.batch, self.mesh, self.rules)
        try:
            for step in range(self.steps):
                jax.block_until_ready(feed.global_batch(source, step))
        finally:
            feed.close()
            source.close()
        return {"samples": self.steps * self.batch, "bytes": source.bytes_read,
                "wait_s": feed.total_wait_s}


# ------------------------------------------------------------------ 1. feed vs raw read


def feed_vs_raw(fmt: str, path: Path, records: int, args: argparse.Namespace) -> dict:
    """Interleaved repetitions (raw, feed / feed, raw, ...), each cold then warm."""
    members = members_of(path)           # builds the index (not timed)
    disk = files_of(path)
    epoch = FeedEpoch(path, args.grid, args.batch, args.seed, args.prefetch,
                      args.read_threads, shuffle_block=args.shuffle_block,
                      shuffle_mix=args.shuffle_mix)
    runners = {"raw": lambda: {"samples": records,
                               "bytes": raw_read(members, ["train/u0", "train/u1"])},
               "feed": epoch}
    if args.prefetch:                    # the same reads in the caller's thread
        runners["feed_sync"] = FeedEpoch(path, args.grid, args.batch, args.seed, 0,
                                         args.read_threads, shuffle_block=args.shuffle_block,
                      shuffle_mix=args.shuffle_mix)
    shuffled = ShuffledRecords(members, ["train/u0", "train/u1"], args.seed) \
        if fmt in ("hdf5", "netcdf") else None
    if shuffled is not None:
        runners["shuffled"] = lambda: {"samples": records, "bytes": shuffled()}
    for run in runners.values():         # warm-up: imports, first make_array, the index
        run()
    caches = ("cold", "warm") if args.cold else ("warm",)
    seconds = {(c, n): [] for c in caches for n in runners}
    done: dict[str, dict] = {}
    applied = args.cold
    for rep in range(args.reps):
        for cache in caches:
            names = [n for n in ("raw", "feed", "feed_sync", "shuffled") if n in runners]
            for name in (names if rep % 2 == 0 else names[::-1]):
                if cache == "cold":
                    applied = drop_cache(disk) and applied
                began = time.perf_counter()
                done[name] = runners[name]()
                seconds[(cache, name)].append(time.perf_counter() - began)
    out: dict = {"files": len(members), "disk_files": len(disk), "cold_cache_applied": applied,
                 "feed_steps": epoch.steps}
    for cache in caches:
        row: dict = {}
        for name, did in done.items():
            secs = seconds[(cache, name)]
            row[name] = {"s": Stats.of(secs).as_dict(),
                         "samples_per_s": did["samples"] / Stats.of(secs).median,
                         "MBps": did["bytes"] / MB / Stats.of(secs).median}
        rate = {n: [done[n]["samples"] / s for s in seconds[(cache, n)]] for n in done}
        row["ratio"] = Stats.of(paired_ratios(rate["feed"], rate["raw"])).as_dict(4)
        if "feed_sync" in rate:
            row["sync_over_raw"] = Stats.of(
                paired_ratios(rate["feed_sync"], rate["raw"])).as_dict(4)
        if "shuffled" in rate:
            row["shuffled_over_raw"] = Stats.of(
                paired_ratios(rate["shuffled"], rate["raw"])).as_dict(4)
            row["feed_over_shuffled"] = Stats.of(
                paired_ratios(rate["feed"], rate["shuffled"])).as_dict(4)
        out[cache] = row
    if shuffled is not None:
        shuffled.close()
    if args.profile:
        out["profile"] = profile_feed(path, args)
    return out


def profile_feed(path: Path, args: argparse.Namespace) -> dict:
    """Where a warm epoch's time goes, per sample (first PROFILE_STEPS steps): the record
    index lookups, single-record reads straight from the store, `ArraySource.rows` and
    `global_batch` in this thread (prefetch 0, under cProfile: top own time), and
    `global_batch` with 1 read thread against `--read-threads` (do threads help?)."""
    from spmd.data.formats.stores import Store

    sync = FeedEpoch(path, args.grid, args.batch, args.seed, 0, 1, PROFILE_STEPS)
    samples = sync.steps * args.batch
    source = sync.source(None)
    source.rows(0, 0, args.batch)                       # opens the members
    timings: dict[str, float] = {}
    began = time.perf_counter()
    records = [r for step in range(sync.steps)
               for r in source.record_indices(step, 0, args.batch)]
    timings["index_lookup"] = time.perf_counter() - began
    stores = [Store(p, str(p), fmt) for p, fmt in members_of(path)]
    arrays = {(i, name): store.get(dataset, name) for i, store in enumerate(stores)
              for name, dataset in source.datasets.items()}
    where = [(name, *source.locate(name, r)) for r in records for name in source.datasets]
    began = time.perf_counter()
    for name, member, row in where:
        arrays[member, name][row, ...]
    timings["store_reads"] = time.perf_counter() - began
    for store in stores:
        store.close()
    began = time.perf_counter()
    for step in range(sync.steps):
        source.rows(step, 0, args.batch)
    timings["source_rows"] = time.perf_counter() - began
    source.close()
    sync()
    began = time.perf_counter()
    sync()
    timings["global_batch_sync"] = time.perf_counter() - began
    prof = cProfile.Profile()
    began = time.perf_counter()
    prof.enable()
    sync()
    prof.disable()
    timings["global_batch_sync_profiled"] = time.perf_counter() - began
    stats = pstats.Stats(prof, stream=io.StringIO())
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:12]   # by own time
    top = [{"function": f"{Path(f).name}:{line}({fn})", "calls": nc, "own_s": round(tt, 4),
            "cumulative_s": round(ct, 4)} for (f, line, fn), (_, nc, tt, ct, _) in rows]
    for n in sorted({1, 4, args.read_threads}):
        epoch = FeedEpoch(path, args.grid, args.batch, args.seed, args.prefetch, n,
                          PROFILE_STEPS)
        began = time.perf_counter()
        epoch()
        timings[f"global_batch_prefetch_{args.prefetch}_threads_{n}"] = \
            time.perf_counter() - began
    members = members_of(path)
    began = time.perf_counter()
    whole = raw_read(members, ["train/u0", "train/u1"])
    timings["raw_whole_files"] = (time.perf_counter() - began) * samples / \
        (whole / (2 * args.grid * args.grid * 4))
    return {"samples": samples,
            "us_per_sample": {k: round(v / samples * 1e6, 1) for k, v in timings.items()},
            "top_own_time": top}


# ------------------------------------------------------------------ 1b. gridded files

GRIDDED_LAYOUTS = ("nc_plain", "nc_packed", "nc_zlib_default", "nc_zlib_1xy", "zarr_t4")
# CF packing as the Climate Data Store packs ERA5: int16 with scale_factor and add_offset
PACKING = {"dtype": "int16", "scale_factor": 0.001, "add_offset": 0.0, "_FillValue": -32767}
GRIDDED_VARIABLES = ("t2m", "u10", "v10", "msl")
RAW_BLOCK = 256             # time steps per read of the plain block read


def make_gridded(root: Path, layout: str, files: int, steps: int, nlat: int, nlon: int,
                 seed: int = 0) -> Path:
    """ERA5-like data written by xarray in `layout`: `files` NetCDF4 files of `steps` 6-hourly
    times each (dims time, latitude, longitude; GRIDDED_VARIABLES float32), or one Zarr v3
    store of every time. nc_plain: contiguous; nc_zlib_default: zlib, netCDF's default
    chunks; nc_zlib_1xy: zlib, chunks 1 x lat x lon; zarr_t4: chunks of 4 time steps;
    nc_packed: contiguous int16 packed with scale_factor / add_offset (CF), as ERA5 comes."""
    import numpy as np
    import xarray as xr

    rng = np.random.default_rng(seed)
    lat = np.linspace(90, -90, nlat)
    lon = np.arange(nlon) * (360.0 / nlon)
    t0 = np.datetime64("2000-01-01T00", "ns")
    every = np.arange(files * steps) * np.timedelta64(6, "h") + t0
    smooth = np.sin(np.linspace(0, 6, nlat))[:, None] * np.cos(np.linspace(0, 9, nlon))[None]

    def dataset(t: np.ndarray) -> xr.Dataset:
        data = {}
        for v in GRIDDED_VARIABLES:
            noise = rng.standard_normal((len(t), nlat, nlon), dtype=np.float32)
            data[v] = (("time", "latitude", "longitude"),
                       np.round(smooth[None] * 10 + noise, 2).astype(np.float32))
        return xr.Dataset(data, coords={"time": t, "latitude": lat, "longitude": lon})

    out = root / layout
    if layout == "zarr_t4":
        ds = dataset(every)
        enc = {v: {"chunks": (4, nlat, nlon)} for v in GRIDDED_VARIABLES}
        store = root / f"{layout}.zarr"
        ds.to_zarr(store, encoding=enc, zarr_format=3, consolidated=False, mode="w")
        fsync_all(files_of(store))
        return store
    out.mkdir(parents=True)
    for i in range(files):
        ds = dataset(every[i * steps:(i + 1) * steps])
        enc: dict = {v: {} for v in GRIDDED_VARIABLES}
        if layout == "nc_packed":
            enc = {v: dict(PACKING) for v in GRIDDED_VARIABLES}
        elif layout != "nc_plain":
            for v in GRIDDED_VARIABLES:
                enc[v].update(zlib=True, complevel=4)
                if layout == "nc_zlib_1xy":
                    enc[v]["chunksizes"] = (1, nlat, nlon)
        ds.to_netcdf(out / f"era5_{i:03d}.nc", encoding=enc, engine="netcdf4",
                     format="NETCDF4")
    fsync_all(files_of(out))
    return out


def gridded_raw_read(path: Path, variables: tuple[str, ...]) -> int:
    """Every variable of every file (or the store) read in blocks of RAW_BLOCK time steps
    with h5py / zarr, in time order, this thread; the bytes read."""
    import h5py
    import numpy as np

    nbytes = 0
    if path.suffix == ".zarr":
        import zarr

        group = zarr.open_group(str(path), mode="r")
        for name in variables:
            array = group[name]
            for a in range(0, array.shape[0], RAW_BLOCK):
                nbytes += np.asarray(array[a:a + RAW_BLOCK]).nbytes
        return nbytes
    for p in sorted(path.glob("*.nc")):
        with h5py.File(p, "r") as f:
            for name in variables:
                d = f[name]
                for a in range(0, d.shape[0], RAW_BLOCK):
                    nbytes += d[a:a + RAW_BLOCK].nbytes
    return nbytes


def gridded_plain_windows(path: Path, variables: tuple[str, ...], batch: int) -> int:
    """The least a hand-written loader does to hand a model the same windows: every file
    read with h5py (or the store with zarr) in blocks of RAW_BLOCK time steps, the variables
    stacked as channels (time, lat, lon, C), and consecutive (t, t+1) windows cut into
    batches of `batch` with NumPy (input frames[i], target frames[i + 1]); in time order,
    no shuffle, no decoding, no device. Windows cross block and file boundaries, as the
    feed's do. The windows made."""
    import h5py
    import numpy as np

    def blocks():
        if path.suffix == ".zarr":
            import zarr

            group = zarr.open_group(str(path), mode="r")
            n = group[variables[0]].shape[0]
            for a in range(0, n, RAW_BLOCK):
                yield np.stack([np.asarray(group[v][a:a + RAW_BLOCK]) for v in variables], -1)
            return
        for p in sorted(path.glob("*.nc")):
            with h5py.File(p, "r") as f:
                n = f[variables[0]].shape[0]
                for a in range(0, n, RAW_BLOCK):
                    yield np.stack([f[v][a:a + RAW_BLOCK] for v in variables], -1)

    made, last = 0, None
    for block in blocks():
        if last is not None:   # the window across the boundary: its two frames, one window
            made += len(np.stack([last, block[0]])) - 1
        starts = np.arange(len(block) - 1)
        for a in range(0, len(starts), batch):
            idx = starts[a:a + batch]
            batch_windows = (block[idx], block[idx + 1])       # (input, target), copied
            made += len(batch_windows[0])
        last = block[-1]
    return made


def gridded_xarray_loop(path: Path, variables: tuple[str, ...], batch: int, seed: int) -> int:
    """The loop a scientist writes with xarray (issue 49's measure): open the files (or the
    store) with xarray, `.load()` them (CF decoding: packed values become floats), stack the
    variables as channels (time, lat, lon, C), then cut the same seeded shuffled (t, t+1)
    windows in full batches of `batch`, as many as the feed's epoch, and hand each batch to
    the device with `jax.device_put`. The windows made."""
    import jax
    import numpy as np
    import xarray as xr

    if path.suffix == ".zarr":
        datasets = [xr.open_zarr(path, consolidated=False).load()]
    else:
        datasets = [xr.open_dataset(p).load() for p in sorted(path.glob("*.nc"))]
    frames = np.concatenate([np.stack([ds[v].values for v in variables], -1)
                             for ds in datasets])
    order = np.random.default_rng(seed).permutation(len(frames) - 1)
    made = 0
    for a in range(0, len(order) - batch + 1, batch):
        idx = order[a:a + batch]
        jax.block_until_ready(jax.device_put((frames[idx], frames[idx + 1])))
        made += batch
    return made


class GriddedEpoch:
    """An epoch of (t, t+1) windows of every variable through GriddedWindowSource and the
    real feed (BatchFeed.global_batch), as training reads them (seeded shuffle)."""

    def __init__(self, path: Path, nlat: int, nlon: int, batch: int, seed: int,
                 prefetch: int, threads: int):
        import jax
        import numpy as np

        from spmd.config.schema import MeshConfig
        from spmd.data import BatchField
        from spmd.engine.mesh import build_mesh
        from spmd.sharding import rules_for

        self.path, self.batch, self.seed = path, batch, seed
        self.prefetch, self.threads = prefetch, threads
        axes = ("batch", "x", "y", "channels")
        c = len(GRIDDED_VARIABLES)
        self.fields = {n: BatchField((nlat, nlon, c), np.float32, axes)
                       for n in ("input", "target")}
        self.mesh = build_mesh(MeshConfig(strategy="dp"), jax.devices())
        self.rules = rules_for("dp")
        self.steps = self.source(None).count // batch

    def source(self, until: int | None):
        from spmd.data.cf.channels import parse_channels
        from spmd.data.sources.gridded_windows import GriddedWindowSource

        return GriddedWindowSource(self.path, parse_channels(list(GRIDDED_VARIABLES)),
                                   self.fields, self.batch, input_name="input",
                                   target_name="target", seed=self.seed, shuffle=True,
                                   prefetch=self.prefetch, read_threads=self.threads,
                                   prefetch_until=until)

    def __call__(self) -> dict:
        import jax

        from spmd.data.loader.feed import BatchFeed

        source = self.source(self.steps)
        feed = BatchFeed(self.fields, self.batch, self.mesh, self.rules)
        try:
            for step in range(self.steps):
                jax.block_until_ready(feed.global_batch(source, step))
        finally:
            feed.close()
            source.close()
        return {"samples": self.steps * self.batch}


def gridded_vs_raw(layout: str, path: Path, args: argparse.Namespace) -> dict:
    """Paired, interleaved repetitions of the feed, the plain block read and the plain
    windows (`gridded_plain_windows`), cold then warm. Samples: (t, t+1) windows; the plain
    read's samples are the windows of the bytes it read (every time of every variable once)."""
    epoch = GriddedEpoch(path, args.nlat, args.nlon, args.batch, args.seed, args.prefetch,
                         args.read_threads)
    windows = epoch.source(None).count
    disk = files_of(path)
    runners = {"raw": lambda: {"samples": windows,
                               "bytes": gridded_raw_read(path, GRIDDED_VARIABLES)},
               "windows": lambda: {"samples": gridded_plain_windows(path, GRIDDED_VARIABLES,
                                                                    args.batch)},
               "xarray": lambda: {"samples": gridded_xarray_loop(path, GRIDDED_VARIABLES,
                                                                 args.batch, args.seed)},
               "feed": epoch}
    for run in runners.values():          # warm-up: imports, the index, the timeline
        run()
    caches = ("cold", "warm") if args.cold else ("warm",)
    seconds = {(c, n): [] for c in caches for n in runners}
    done: dict[str, dict] = {}
    applied = args.cold
    for rep in range(args.reps):
        for cache in caches:
            for name in (("raw", "windows", "xarray", "feed") if rep % 2 == 0
                         else ("feed", "xarray", "windows", "raw")):
                if cache == "cold":
                    applied = drop_cache(disk) and applied
                began = time.perf_counter()
                done[name] = runners[name]()
                seconds[(cache, name)].append(time.perf_counter() - began)
    source = epoch.source(None)
    try:
        warnings = source.layout_warnings()
    finally:
        source.close()
    out: dict = {"layout": layout, "windows": windows, "feed_steps": epoch.steps,
                 "disk_files": len(disk), "disk_MB": round(sum(p.stat().st_size
                                                                 for p in disk) / MB, 2),
                 "cold_cache_applied": applied, "layout_warnings": warnings}
    for cache in caches:
        rate = {n: [done[n]["samples"] / s for s in seconds[(cache, n)]] for n in done}
        out[cache] = {n: {"s": Stats.of(seconds[(cache, n)]).as_dict(),
                          "samples_per_s": done[n]["samples"] /
                          Stats.of(seconds[(cache, n)]).median} for n in done}
        out[cache]["ratio"] = Stats.of(paired_ratios(rate["feed"], rate["raw"])).as_dict(4)
        out[cache]["ratio_plain_windows"] = Stats.of(
            paired_ratios(rate["feed"], rate["windows"])).as_dict(4)
        out[cache]["ratio_xarray_loop"] = Stats.of(
            paired_ratios(rate["feed"], rate["xarray"])).as_dict(4)
    return out


# ------------------------------------------------------------------ 2. input wait


def input_wait_summary(records: list[dict], skip: int = 1) -> dict | None:
    """From metrics.jsonl train records (`input_wait_s`, `step_time_s` per logged step;
    every step logged), over the steps after the first `skip`: the input-wait fraction
    sum(wait) / sum(step time), and the samples/s the steps consumed (`batch_size`)."""
    train = [r for r in records
             if isinstance(r.get("input_wait_s"), int | float) and "step_time_s" in r]
    train = sorted(train, key=lambda r: r["step"])[skip:]
    if not train:
        return None
    wait = sum(float(r["input_wait_s"]) for r in train)
    step = sum(float(r["step_time_s"]) for r in train)
    waits = sorted(float(r["input_wait_s"]) for r in train)
    return {"steps": len(train), "first_step": train[0]["step"], "input_wait_s": wait,
            "step_time_s": step, "fraction": wait / step,
            "max_wait_s": waits[-1], "median_wait_s": waits[len(waits) // 2],
            "median_step_s": sorted(float(r["step_time_s"]) for r in train)[len(train) // 2]}


def train_input_wait(args: argparse.Namespace, root: Path) -> dict:
    """Train `args.config` in a subprocess, then compare its consumption with a raw read."""
    from spmd.config.load import build_task, load_config

    config = Path(args.config).resolve()
    base = load_config(str(config), list(args.set))
    run_dir = root / "train-run"
    overrides = [f"run.dir={run_dir}", f"train.steps={args.train_steps}", "run.log_every=1",
                 "train.eval_every=0", "checkpoint.every=0", "checkpoint.persistent_every=0",
                 "run.progress=false", "run.plots=false"]
    if base.data.path is not None:
        overrides.append(f"data.path={root / 'train-data' / Path(base.data.path).name}")
    overrides += list(args.set)
    cmd = [sys.executable, "-m", "spmd.cli", "train", str(config), *overrides]
    began = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    wall = time.perf_counter() - began
    if proc.returncode != 0:
        raise SystemExit(f"training failed (exit {proc.returncode}): {' '.join(cmd)}\n"
                         f"{proc.stderr[-3000:]}")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    summary = input_wait_summary([json.loads(x) for x in lines if x.strip()])
    if summary is None:
        raise SystemExit(f"{run_dir / 'metrics.jsonl'}: no train record after the first step "
                         f"(raise --train-steps above {args.train_steps})")
    cfg = load_config(str(config), overrides)
    batch = cfg.train.batch_size
    shown = [o for o in overrides if not o.startswith(("run.dir=", "data.path="))]
    out = {"config": str(config.relative_to(REPO) if config.is_relative_to(REPO) else config),
           "command": "spmd train CONFIG " + " ".join(shown),
           "wall_s": round(wall, 2), "batch_size": batch, **summary,
           "consumed_samples_per_s": batch * summary["steps"] / summary["step_time_s"]}
    task = build_task(cfg)
    fields = task.batch_fields()
    out["feed_bytes_per_sample"] = sum(f.dtype.itemsize * math.prod(f.example_shape)
                                       for f in fields.values())
    if cfg.data.path is None:
        out["raw"] = None                # generated in memory: nothing to read
        return out
    source = task.train_source()
    members = [(m.path, m.format) for m in source.files.members]
    datasets = sorted(set(source.datasets.values()))
    disk = [f for p, _ in members for f in files_of(p)]
    raw = {"samples": source.count, "datasets": datasets, "files": len(members)}
    nbytes = raw_read(members, datasets)                  # warm-up (imports, metadata)
    for cache in (("cold", "warm") if args.cold else ("warm",)):
        secs = []
        for _ in range(args.reps):
            if cache == "cold":
                raw["cold_cache_applied"] = drop_cache(disk) and raw.get("cold_cache_applied",
                                                                         True)
            began = time.perf_counter()
            raw_read(members, datasets)
            secs.append(time.perf_counter() - began)
        median = Stats.of(secs).median
        raw[cache] = {"s": Stats.of(secs).as_dict(), "MBps": nbytes / MB / median,
                      "samples_per_s": source.count / median}
    raw["bytes"] = nbytes
    raw["bytes_per_sample"] = nbytes / source.count
    out["raw"] = raw
    slowest = raw["cold" if args.cold else "warm"]["samples_per_s"]
    out["raw_outruns_consumption"] = slowest > out["consumed_samples_per_s"]
    return out


# ------------------------------------------------------------------ main




def shuffle_block(text: str) -> int | str:
    """--shuffle-block: auto, full or a number of records."""
    if text in ("auto", "full"):
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"give auto, full or a number of records >= 1, "
                                         f"not {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=512, help="dataset size in MiB (default 512)")
    ap.add_argument("--formats", default="hdf5,zarr", help="comma-separated (hdf5, zarr)")
    ap.add_argument("--files", type=int, default=8, help="stores in the dataset (default 8)")
    ap.add_argument("--grid", type=int, default=64, help="examples are grid x grid x 1")
    ap.add_argument("--batch", type=int, default=32, help="global batch of the feed (32)")
    ap.add_argument("--prefetch", type=int, default=2, help="data.prefetch (default 2)")
    ap.add_argument("--read-threads", type=int, default=1, help="data.read_threads (1)")
    ap.add_argument("--reps", type=int, default=3, help="interleaved repetitions (3)")
    ap.add_argument("--shuffle-block", type=shuffle_block, default="auto",
                    help="data.shuffle_block of the feed: auto (the default: blocks of about "
                         "4 MiB), full (a full shuffle) or a number of records")
    ap.add_argument("--shuffle-mix", type=int, default=16,
                    help="data.shuffle_mix of the feed: blocks read at a time (default 16)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-cold", dest="cold", action="store_false",
                    help="skip the cold-cache measurements")
    ap.add_argument("--config", type=Path, default=next((c for c in CONFIGS if c.exists()),
                                                         CONFIGS[-1]),
                    help="training config of part 2 (default examples/kolmogorov, else vit2d)")
    ap.add_argument("--train-steps", type=int, default=None,
                    help="steps of the training run (default 200, --quick 6; 0: skip)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="extra override of the training run (repeatable)")
    ap.add_argument("--dir", type=Path, default=None, help="where to write (default: /tmp)")
    ap.add_argument("--json", type=Path, default=None, help="also write the JSON document here")
    ap.add_argument("--profile", action="store_true", help="cProfile a feed epoch per format")
    ap.add_argument("--gridded", default=",".join(GRIDDED_LAYOUTS),
                    help="xarray-written layouts of the gridded (weather) cases, "
                         f"comma-separated from {','.join(GRIDDED_LAYOUTS)} ('' skips them)")
    ap.add_argument("--gridded-files", type=int, default=2,
                    help="NetCDF4 files of the gridded cases (default 2, one per 'year')")
    ap.add_argument("--gridded-steps", type=int, default=1464,
                    help="time steps per gridded file (default 1464: a 6-hourly year; "
                         "--quick 64)")
    ap.add_argument("--nlat", type=int, default=32, help="gridded latitudes (default 32)")
    ap.add_argument("--nlon", type=int, default=64, help="gridded longitudes (default 64)")
    ap.add_argument("--quick", "--short", dest="quick", action="store_true",
                    help="CI mode: 16 MiB, 1 repetition, 6 training steps, no verdict")
    add_record_option(ap)
    args = ap.parse_args(argv)
    if args.quick:
        args.mb, args.reps = min(args.mb, 16), 1
        args.gridded_steps = min(args.gridded_steps, 64)
    if args.train_steps is None:
        args.train_steps = 6 if args.quick else 200
    formats = [f for f in args.formats.split(",") if f]
    bad = [f for f in formats if f not in ("hdf5", "zarr", "netcdf")]
    if bad:
        ap.error(f"--formats: unknown {bad} (hdf5, zarr, netcdf)")
    layouts = [x for x in args.gridded.split(",") if x]
    bad = [x for x in layouts if x not in GRIDDED_LAYOUTS]
    if bad:
        ap.error(f"--gridded: unknown {bad} ({', '.join(GRIDDED_LAYOUTS)})")
    args.layouts = layouts
    root = Path(tempfile.mkdtemp(prefix="data-bench-", dir=args.dir))
    try:
        return run(args, formats, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run(args: argparse.Namespace, formats: list[str], root: Path) -> int:
    record: dict = {"benchmark": "data_throughput", "mode": "quick" if args.quick else "full",
                    "machine": machine(), "versions": versions(),
                    "dataset": {"mb": args.mb, "files": args.files,
                                "fields": {"train/u0": [args.grid, args.grid, 1],
                                           "train/u1": [args.grid, args.grid, 1]},
                                "dtype": "float32", "chunk": "one example"},
                    "feed": {"batch_size": args.batch, "prefetch": args.prefetch,
                             "read_threads": args.read_threads, "shuffle": True,
                             "shuffle_block": args.shuffle_block,
                             "shuffle_mix": args.shuffle_mix,
                             "seed": args.seed},
                    "cold_cache": {"method": "os.posix_fadvise(POSIX_FADV_DONTNEED) on every "
                                             "file after fsync", "requested": args.cold},
                    "targets": {"feed_over_raw": FEED_TARGET, "input_wait_fraction": WAIT_TARGET},
                    "formats": {}}
    rows = [("format", "cache", "raw samples/s", "raw MB/s", "feed samples/s", "feed MB/s",
             "feed/raw (paired median)", "no-prefetch/raw", "shuffled/raw",
             "feed/shuffled")]
    for fmt in formats:
        began = time.perf_counter()
        path, records = make_dataset(root, fmt, args.mb, args.files, args.grid, args.seed)
        written = time.perf_counter() - began
        r = feed_vs_raw(fmt, path, records, args)
        r.update(records=records, write_s=round(written, 2))
        record["formats"][fmt] = r
        for cache in ("cold", "warm"):
            if cache in r:
                c = r[cache]
                rows.append((fmt, cache if cache == "warm" or r["cold_cache_applied"]
                             else "cold (not applied)",
                             f"{c['raw']['samples_per_s']:.0f}", f"{c['raw']['MBps']:.0f}",
                             f"{c['feed']['samples_per_s']:.0f}", f"{c['feed']['MBps']:.0f}",
                             f"{c['ratio']['median']:.3f} [{c['ratio']['min']:.3f}, "
                             f"{c['ratio']['max']:.3f}]",
                             *(f"{c[k]['median']:.3f}" if k in c else "-"
                               for k in ("sync_over_raw", "shuffled_over_raw",
                                         "feed_over_shuffled"))))
        shutil.rmtree(path, ignore_errors=True)
    record["gridded"] = {
        "variables": list(GRIDDED_VARIABLES), "grid": [args.nlat, args.nlon],
        "files": args.gridded_files, "steps_per_file": args.gridded_steps,
        "window": "(t, t+1)", "raw_block_steps": RAW_BLOCK, "writer": "xarray",
        "layouts": {}}
    grows = [("layout", "cache", "plain read samples/s", "plain windows samples/s",
              "xarray loop samples/s", "feed samples/s", "feed/plain [min, max]",
              "feed/plain windows [min, max]", "feed/xarray loop [min, max]",
              "layout warning")]
    for layout in args.layouts:
        began = time.perf_counter()
        path = make_gridded(root, layout, args.gridded_files, args.gridded_steps, args.nlat,
                            args.nlon, args.seed)
        written = time.perf_counter() - began
        r = gridded_vs_raw(layout, path, args)
        r["write_s"] = round(written, 2)
        record["gridded"]["layouts"][layout] = r
        for cache in ("cold", "warm"):
            if cache in r:
                c, w, x = (r[cache], r[cache]["ratio_plain_windows"],
                           r[cache]["ratio_xarray_loop"])
                grows.append((layout, cache if cache == "warm" or r["cold_cache_applied"]
                              else "cold (not applied)",
                              f"{c['raw']['samples_per_s']:.0f}",
                              f"{c['windows']['samples_per_s']:.0f}",
                              f"{c['xarray']['samples_per_s']:.0f}",
                              f"{c['feed']['samples_per_s']:.0f}",
                              f"{c['ratio']['median']:.3f} [{c['ratio']['min']:.3f}, "
                              f"{c['ratio']['max']:.3f}]",
                              f"{w['median']:.3f} [{w['min']:.3f}, {w['max']:.3f}]",
                              f"{x['median']:.3f} [{x['min']:.3f}, {x['max']:.3f}]",
                              "yes" if r["layout_warnings"] else "no"))
        shutil.rmtree(path, ignore_errors=True)
    train = train_input_wait(args, root) if args.train_steps > 0 else None
    record["train"] = train
    ratios = [r[c]["ratio"]["median"] for r in record["formats"].values()
              for c in ("cold", "warm") if c in r]
    # gridded: the plain windows (>= 0.8) and the xarray loop (>= 1.0); a layout that spmd
    # data info warns about (naming a rechunk command) may be slower
    gridded = [r[c] for r in record["gridded"]["layouts"].values()
               for c in ("cold", "warm") if c in r and not r["layout_warnings"]]
    ratios += [c["ratio_plain_windows"]["median"] for c in gridded]
    xarray_ratios = [c["ratio_xarray_loop"]["median"] for c in gridded]
    feed_ok = (all(x >= FEED_TARGET for x in ratios)
               and all(x >= XARRAY_TARGET for x in xarray_ratios))
    wait_ok = (train is None or not train.get("raw_outruns_consumption", True)
               or train["fraction"] <= WAIT_TARGET)
    verdict = None if args.quick else ("PASS" if feed_ok and wait_ok else "FAIL")
    record["verdict"] = verdict
    record["loadavg_1m_end"] = f"{os.getloadavg()[0]:.2f}"
    report(record, args, rows, ratios + xarray_ratios, grows)
    if args.json is not None:
        args.json.write_text(json.dumps(record, indent=1, default=str))
    emit(record, args)
    return 1 if verdict == "FAIL" else 0


def report(record: dict, args: argparse.Namespace, rows: list, ratios: list[float],
           grows: list) -> None:
    """The human summary: the feed/raw table, the profiles, the training line, the verdict."""
    train, verdict = record["train"], record["verdict"]
    print(f"data throughput ({record['mode']}): {args.mb:g} MiB in {args.files} files per format, "
          f"batch {args.batch}, prefetch {args.prefetch}, read_threads {args.read_threads}, "
          f"shuffle_block {args.shuffle_block}, shuffle_mix {args.shuffle_mix}, "
          f"{args.reps} interleaved reps after a warm-up")
    if len(rows) > 1:
        print(table(rows))
    if len(grows) > 1:
        g = record["gridded"]
        print(f"gridded (xarray-written, {'+'.join(g['variables'])} as channels, "
              f"{g['window']} windows, grid {g['grid'][0]} x {g['grid'][1]}, {g['files']} "
              f"files x {g['steps_per_file']} steps; plain read: h5py / zarr in blocks of "
              f"{g['raw_block_steps']} steps)")
        print(table(grows))
    for fmt, r in record["formats"].items():
        if "profile" in r:
            p = r["profile"]
            print(f"profile {fmt} (us per sample, warm, first {p['samples']} samples): "
                  + ", ".join(f"{k} {v}" for k, v in p["us_per_sample"].items()))
            for t in p["top_own_time"][:8]:
                print(f"  {t['own_s']:8.3f} s own {t['cumulative_s']:8.3f} s cum "
                      f"{t['calls']:8d}  {t['function']}")
    if train is not None:
        raw = train["raw"]
        line = (f"training ({train['config']}, {train['steps']} steps after the first, batch "
                f"{train['batch_size']}): input wait {train['input_wait_s']:.4f} s of "
                f"{train['step_time_s']:.3f} s step time = fraction {train['fraction']:.4f} "
                f"(target <= {WAIT_TARGET}); consumes {train['consumed_samples_per_s']:.0f} "
                f"samples/s")
        if raw is not None:
            best = raw["cold" if "cold" in raw else "warm"]
            line += (f", raw read of the same data {best['samples_per_s']:.0f} samples/s "
                     f"({raw['bytes_per_sample']:.0f} B/sample): raw / consumption "
                     f"{best['samples_per_s'] / train['consumed_samples_per_s']:.1f}x")
        print(line)
    if verdict is None:
        print("quick mode: timings are a smoke test, no target is checked")
    else:
        worst = f"{min(ratios):.3f}" if ratios else "n/a"
        print(f"{verdict}: feed/raw (gridded: feed/plain windows) {worst} at worst (target "
              f">= {FEED_TARGET}; gridded feed/xarray loop >= {XARRAY_TARGET}), "
              f"input-wait fraction "
              f"{'n/a' if train is None else format(train['fraction'], '.4f')} "
              f"(target <= {WAIT_TARGET} when the raw read outruns the step)")


if __name__ == "__main__":
    sys.exit(main())
