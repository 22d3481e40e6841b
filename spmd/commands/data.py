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
    from spmd.config import load_config
    from spmd.data.fields import describe
    from spmd.errors import SpmdError
    from spmd.tasks.operator import dataset_path, make_dataset, validate_dataset

    cfg = load_config(args.config, args.overrides)
    if cfg.model.name != "fno":
        raise SpmdError(f"model.name={cfg.model.name} has no dataset to make; `spmd data` "
                        f"serves model.name=fno (it generates its own data otherwise)")
    path = dataset_path(cfg)
    if args.action == "info":
        print(describe(validate_dataset(cfg)))
        return 0
    if args.workers < 1:
        raise SpmdError("--workers must be >= 1")
    if path.exists() and not args.force:
        info = validate_dataset(cfg)
        print(f"{describe(info)} exists and fits the config; --force to remake it")
        return 0
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger("spmd")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    info = make_dataset(cfg, workers=args.workers, compression=args.compression)
    print(describe(info))
    return 0
