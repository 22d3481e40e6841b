"""`spmd train CONFIG [key=value ...]`: one rank's entry point (every rank runs it)."""

from __future__ import annotations

import argparse

from spmd.cli.main import JAX_STACK

# what run() imports, loaded by spmd.cli.main with the garbage collector off (load_stack)
STACK = (*JAX_STACK, "spmd.api", "spmd.config.load", "spmd.loop.trainer")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train (one rank; run under srun/jsrun/mpiexec or `spmd run`)")
    p.add_argument("config", help="YAML config file")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    add_verbose(p)
    p.set_defaults(func=run)


def add_verbose(p: argparse.ArgumentParser) -> None:
    """-v / --verbose: the internal `key=value` records on the console too (run.log_level)."""
    p.add_argument("-v", "--verbose", action="store_true",
                   help="show the internal key=value records (events, leases, saves) on the "
                        "console too, not only in run.dir/logs (= run.log_level=debug)")


def verbose_overrides(args: argparse.Namespace) -> list[str]:
    """The config overrides with `run.log_level=debug` added for -v."""
    return [*args.overrides, *(["run.log_level=debug"] if args.verbose else [])]


def run(args: argparse.Namespace) -> int:
    from spmd.api import train
    from spmd.config.load import load_config

    cfg = load_config(args.config, verbose_overrides(args))  # before touching JAX or MPI
    return train(cfg, debug=args.debug)
