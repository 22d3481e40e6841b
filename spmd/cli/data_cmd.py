"""`spmd data make CONFIG [key=value ...]`: solve the config's PDE dataset and write data.path."""

from __future__ import annotations

import argparse
import logging
import sys


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
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger("spmd")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    made = task.make_data(workers=args.workers, force=args.force, compression=args.compression)
    if made is None:
        raise SpmdError(f"task {cfg.task} has no data set to make (it generates its data)")
    print(made)
    return 0
