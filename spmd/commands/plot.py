"""`spmd plot RUN_DIR`: PNG curves of a run and its sample fields, in RUN_DIR/plots/."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plot", help="loss, test-error and throughput curves (PNG) of a run")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (run.dir)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from spmd.plots import make_plots

    for path in make_plots(Path(args.run_dir)):
        print(path)
    return 0
