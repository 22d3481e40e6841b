"""`spmd plot RUN_DIR`: PNG curves of a run and its sample fields, in RUN_DIR/plots/."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plot", help="loss, test-error and throughput curves (PNG) of a run")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (run.dir)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from spmd.rundir.plots import make_plots

    run_dir = Path(args.run_dir)
    for path in make_plots(run_dir, _task_of(run_dir)):
        print(path)
    return 0


def _task_of(run_dir: Path):
    """The run's task (from its resolved config.yaml) for its own figures; None without one."""
    config = run_dir / "config.yaml"
    if not config.is_file():
        return None
    from spmd.config.load import build_task, load_config

    return build_task(load_config(config))
