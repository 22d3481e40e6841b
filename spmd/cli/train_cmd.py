"""`spmd train CONFIG [key=value ...]`: one rank's entry point (every rank runs it)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train (one rank; run under srun/jsrun/mpiexec or `spmd run`)")
    p.add_argument("config", help="YAML config file")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from spmd.api import train
    from spmd.config.load import load_config

    cfg = load_config(args.config, args.overrides)  # validate before touching JAX or MPI
    return train(cfg, debug=args.debug)
