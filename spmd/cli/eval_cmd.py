"""`spmd eval PATH [--split test] [--step N] [--json] [key=value ...]`: a run's trained
parameters evaluated with its task's metrics, as the trainer evaluates (one process, or
every rank under `spmd run -n N --entry eval PATH -- ...`, srun, mpiexec)."""

from __future__ import annotations

import argparse
import json

from spmd.cli.trained_args import add_overrides_argument, add_trained_run_arguments


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="evaluate a run's trained model on a split")
    add_trained_run_arguments(p)
    p.add_argument("--split", default="test", choices=("test", "train"))
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    add_overrides_argument(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from spmd.inference.evaluation import evaluate_split
    from spmd.inference.loading import trained_job

    with trained_job(args.path, args.step, args.overrides) as (trained, env):
        metrics = evaluate_split(trained, args.split)
    if env.rank == 0:
        if args.json:
            print(json.dumps({"step": trained.step, "split": args.split,
                              "checkpoint": trained.source, "metrics": metrics}))
        else:
            print(f"{trained.config.task}: {trained.source}, split {args.split}")
            for key, value in metrics.items():
                print(f"  {key:<16} {value:.6g}")
    return 0
