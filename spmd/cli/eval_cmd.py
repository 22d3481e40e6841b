"""`spmd eval PATH [--split test] [--batches N] [--step N] [--json] [key=value ...]`: a run's
trained parameters evaluated with its task's metrics on every window of a split, once (one
process, or every rank under `spmd run -n N --entry eval PATH -- ...`, srun, mpiexec). It says
how many windows it scored, of how many, and the time range they cover."""

from __future__ import annotations

import argparse
import json

from spmd.cli.main import JAX_STACK
from spmd.cli.trained_args import add_overrides_argument, add_trained_run_arguments

# what run() imports, loaded by spmd.cli.main with the garbage collector off (load_stack)
STACK = (*JAX_STACK, "spmd.inference.evaluation", "spmd.inference.loading")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="evaluate a run's trained model on a split")
    add_trained_run_arguments(p)
    p.add_argument("--split", default="test", choices=("test", "train"))
    p.add_argument("--batches", type=int, default=None, metavar="N",
                   help="score at most N whole batches (default: every window of the split; "
                        "data.eval_batches scores what the run's own evaluations scored)")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    add_overrides_argument(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from spmd.errors import SpmdError
    from spmd.inference.evaluation import evaluate_split
    from spmd.inference.loading import trained_job

    if args.batches is not None and args.batches < 1:
        raise SpmdError(f"--batches {args.batches}: give a number of batches >= 1")
    with trained_job(args.path, args.step, args.overrides) as (trained, env):
        metrics = evaluate_split(trained, args.split, args.batches)
    if env.rank == 0:
        scored = {k: metrics.pop(k) for k in WINDOW_KEYS if k in metrics}
        if args.json:
            print(json.dumps({"step": trained.step, "split": args.split,
                              "checkpoint": trained.source, **scored, "metrics": metrics}))
        else:
            print(f"{trained.config.task}: {trained.source}, split {args.split}: "
                  f"{windows_text(scored)}")
            for key, value in metrics.items():
                print(f"  {key:<16} {value:.6g}")
    return 0


WINDOW_KEYS = ("windows_scored", "windows_in_split", "windows_from", "windows_to")


def windows_text(scored: dict) -> str:
    """'scored 166 of 166 windows (2019-03-25T00:00 .. 2019-03-31T23:00)'."""
    text = f"scored {scored['windows_scored']} of {scored['windows_in_split']} windows"
    if "windows_from" in scored:
        text += f" ({scored['windows_from']} .. {scored['windows_to']})"
    return text
