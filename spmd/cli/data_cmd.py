"""`spmd data make|info|stats CONFIG [key=value ...]`: make data.path (solve the config's PDE
dataset), describe it, or compute the per-channel statistics that data.normalize uses.
`spmd data rechunk IN OUT` (no config) rewrites gridded files with chunks of one time step (what the
layout warning of `info` asks for).

With data.variables (gridded weather / climate files) `info` prints the timeline, the
splits and the channel table, and `stats` stores the NaN-aware statistics per channel of
the decoded values beside the data (rank 0 computes them), where data.normalize reads them.

`stats` runs in one process or on every rank of a job (mpiexec, srun):
rank r reads its contiguous share of the records, the ranks exchange their partial
statistics as JSON (spmd.comm.RankGroup) and rank 0 merges and stores them beside the data
(spmd.data.stats.normalization).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

log = logging.getLogger("spmd.data.stats")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="make and inspect datasets")
    actions = p.add_subparsers(dest="action", required=True)
    make = actions.add_parser(
        "make", help="solve the PDE for many random inputs and write data.path (HDF5, atomic)")
    make.add_argument("config", help="YAML config file (model.grid, data.* are used)")
    make.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    make.add_argument("--workers", type=int, default=1, help="solver processes (default 1)")
    make.add_argument("--compression", choices=("gzip", "lzf"), default=None,
                      help="HDF5 compression of the fields (default none)")
    make.add_argument("--force", action="store_true",
                      help="replace an existing file (the new one is renamed into place)")
    make.set_defaults(func=run)
    info = actions.add_parser("info", help="check data.path against the config and describe it")
    info.add_argument("config", help="YAML config file")
    info.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    info.set_defaults(func=run)
    stats = actions.add_parser(
        "stats", help="per-channel count, mean, std, min, max of a split's fields, stored "
                      "beside the data (what data.normalize trains with)")
    stats.add_argument("config", help="YAML config file")
    stats.add_argument("overrides", nargs="*", metavar="key=value",
                       help="dotted config overrides")
    stats.add_argument("--split", choices=("train", "test"), default="train",
                       help="the split whose datasets to describe (default train)")
    stats.add_argument("--json", action="store_true", help="one JSON object on stdout")
    stats.set_defaults(func=run_stats)
    rechunk = actions.add_parser(
        "rechunk", help="rewrite NetCDF4 or NetCDF3 files or a Zarr store with chunks of "
                        "TIME_CHUNK x latitude x longitude (the layout spmd data info asks for), "
                        "via xarray")
    rechunk.add_argument("source", help="a NetCDF4 or NetCDF3 file, a directory of them, or a "
                                        "Zarr store")
    rechunk.add_argument("dest", help="the new file, directory or store (must not exist)")
    rechunk.add_argument("--time-chunk", type=int, default=1, help="time steps per chunk (1)")
    rechunk.add_argument("--complevel", type=int, default=4,
                         help="zlib level of NetCDF4 variables (default 4; 0: uncompressed)")
    rechunk.set_defaults(func=run_rechunk)


def run(args: argparse.Namespace) -> int:
    from spmd.config.load import build_task, load_config
    from spmd.errors import SpmdError

    cfg = load_config(args.config, args.overrides)
    task = build_task(cfg)
    if args.action == "info":
        described = task.describe_data()
        if described is None:
            raise SpmdError(f"task {cfg.task} keeps no data set on disk (it generates its data)")
        print(described)
        return 0
    if args.workers < 1:
        raise SpmdError("--workers must be >= 1")
    _log_to_stderr(logging.INFO)
    made = task.make_data(workers=args.workers, force=args.force, compression=args.compression)
    if made is None:
        raise SpmdError(f"task {cfg.task} has no data set to make (it generates its data)")
    print(made)
    return 0


def run_rechunk(args: argparse.Namespace) -> int:
    """`spmd data rechunk IN OUT`: spmd.data.formats.rechunk.rechunk; prints the files written."""
    from spmd.data.formats.rechunk import rechunk

    for path in rechunk(args.source, args.dest, time_chunk=args.time_chunk,
                        complevel=args.complevel):
        print(path)
    return 0


def run_stats(args: argparse.Namespace) -> int:
    """`spmd data stats`: this rank's share, exchanged and merged; rank 0 writes and prints."""
    from spmd.config.load import build_task, load_config
    from spmd.data.sources.arrays import ArraySource
    from spmd.data.sources.gridded_windows import GriddedWindowSource
    from spmd.data.stats.normalization import (
        data_fingerprint,
        merge_statistics,
        partial_statistics,
        write_statistics,
    )
    from spmd.errors import SpmdError
    from spmd.launch import bootstrap, shutdown

    cfg = load_config(args.config, args.overrides)
    env = bootstrap(init_timeout_s=cfg.launch.init_timeout_s,
                    heartbeat_timeout_s=cfg.launch.heartbeat_timeout_s)
    _log_to_stderr(logging.INFO)
    try:
        task = build_task(cfg)
        source = task.train_source() if args.split == "train" else task.eval_source()
        if source is None:
            raise SpmdError(f"task {cfg.task} gives no {args.split} source (a FieldTask "
                            f"evaluates only with train.eval_every > 0: add train.eval_every=1)")
        if not isinstance(source, ArraySource):
            raise SpmdError(f"task {cfg.task} keeps no data on disk (its {args.split} source "
                            f"is a {type(source).__name__}): there is nothing to compute "
                            f"statistics of")
        if isinstance(source, GriddedWindowSource):
            if env.rank == 0:
                print(_channel_stats(source, args.split, args.json))
            return 0
        stamp, part = None, None
        try:
            plan = source.statistics_plan()
            stamp = data_fingerprint(source.path, source.where) if env.rank == 0 else None
            part = partial_statistics(source.path, plan, rank=env.rank, size=env.size,
                                      where=source.where)
        except SpmdError as e:   # told to every rank, so that none waits for this one
            part = {"error": str(e)}
        if "error" not in part:
            _log_share(env, part)
            part.pop("opened")
        parts = [part]
        if env.size > 1:
            from spmd.comm.rank_group import RankGroup

            group = RankGroup(env, cfg.launch.barrier_timeout_s, "launch.barrier_timeout_s",
                              "data-stats")
            parts = [json.loads(t) for t in
                     allgather_text(group, json.dumps(part), "exchange partial statistics")]
        failed = [(r, p["error"]) for r, p in enumerate(parts) if "error" in p]
        if failed:
            rank, message = failed[0]
            raise SpmdError(message if env.size == 1 else f"rank {rank}: {message}")
        if env.rank == 0:
            merged = merge_statistics(parts)
            target = write_statistics(source.path, merged, split=args.split,
                                      fingerprint=stamp, where=source.where)
            stored = json.loads(target.read_text())
            entries = {k: stored["datasets"][k] for k in merged["datasets"]}
            if args.json:
                print(json.dumps({"file": str(target), "data": str(source.path),
                                  "split": args.split, "datasets": entries}))
            else:
                print(_table(target, args.split, entries))
    finally:
        if env.size > 1:
            shutdown()
    return 0


def allgather_text(group: Any, text: str, what: str) -> list[str]:
    """Every rank's `text` of any length (ASCII, e.g. JSON), in rank order: the group's
    string collectives carry at most spmd.launch.mpi.WIDTH bytes per call, so the texts
    travel in pieces of that size (as many calls on every rank)."""
    from spmd.errors import SpmdError
    from spmd.launch.mpi import WIDTH

    lengths = [int(n) for n in group.allgather_str(str(len(text)), what)]
    pieces: list[list[str]] = [[] for _ in lengths]
    for i in range(-(-max(lengths) // WIDTH)):
        for rank, piece in enumerate(group.allgather_str(text[i * WIDTH:(i + 1) * WIDTH],
                                                         what)):
            pieces[rank].append(piece)
    texts = ["".join(p) for p in pieces]
    bad = [r for r, (t, n) in enumerate(zip(texts, lengths)) if len(t) != n]
    if bad:
        raise SpmdError(f"could not {what}: the texts of ranks {bad} arrived incomplete")
    return texts


def _log_share(env: Any, part: dict) -> None:
    """Which records this rank read and which files it opened (INFO; every file at DEBUG)."""
    opened = part["opened"]
    ranges = sorted({tuple(e["range"]) for e in part["datasets"].values()})
    names = (", ".join(opened) if len(opened) <= 8 else
             f"{opened[0]} .. {opened[-1]}")
    log.info("rank %d of %d: records %s of %s; opened %d file(s): %s", env.rank, env.size,
             ", ".join(f"[{lo}, {hi})" for lo, hi in ranges), ", ".join(part["datasets"]),
             len(opened), names)
    log.debug("rank %d opened %s", env.rank, opened)


def _table(target: Any, split: str, entries: dict) -> str:
    lines = [f"statistics of split {split} -> {target}",
             f"{'dataset':<24} {'channel':>7} {'count':>12} {'mean':>13} {'std':>13} "
             f"{'min':>13} {'max':>13}"]
    for dataset, e in entries.items():
        for c in range(len(e["mean"])):
            channel = str(c) if e["per_channel"] else "all"
            lines.append(f"{dataset:<24} {channel:>7} {e['count'][c]:>12} {e['mean'][c]:>13.6g} "
                         f"{e['std'][c]:>13.6g} {e['min'][c]:>13.6g} {e['max'][c]:>13.6g}")
    return "\n".join(lines)


def _channel_stats(source: Any, split: str, as_json: bool) -> str:
    """Store the NaN-aware per-channel statistics of a gridded source's split (data.variables:
    decoded values, over every time of its windows) beside the data, where data.normalize
    reads them; a table or one JSON object of them."""
    from spmd.data.stats.normalization import data_fingerprint, write_statistics

    stamp = data_fingerprint(source.path, source.where)
    part = source.statistics_part()
    key = source.statistics_key()
    names = [c.name for c in source.channels]
    target = write_statistics(source.path, part, split=split, fingerprint=stamp,
                              where=source.where, channel_names={key: names})
    e = json.loads(target.read_text())["datasets"][key]
    if as_json:
        return json.dumps({"file": str(target), "data": str(source.path), "split": split,
                           "dataset": key, "channels": {
                               n: {k: e[k][i] for k in ("count", "missing", "mean", "std",
                                                        "min", "max")}
                               for i, n in enumerate(names)}})
    lines = [f"statistics of split {split} ({key}) -> {target} (NaN left out)",
             f"{'channel':<24} {'count':>12} {'missing':>9} {'mean':>13} {'std':>13} "
             f"{'min':>13} {'max':>13}"]
    for i, name in enumerate(names):
        lines.append(f"{name:<24} {e['count'][i]:>12} {e['missing'][i]:>9} "
                     f"{e['mean'][i]:>13.6g} {e['std'][i]:>13.6g} {e['min'][i]:>13.6g} "
                     f"{e['max'][i]:>13.6g}")
    return "\n".join(lines)


def _log_to_stderr(level: int) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger("spmd")
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
