"""`spmd predict PATH --input FILE --output FILE [--rollout N] [--split test] [...]`: a run's
model over every example of a data file, written to HDF5 (spmd.inference.prediction); one
process, or every rank under `spmd run -n N --entry predict PATH -- --input ...`."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("predict", help="predict with a run's trained model over a data file")
    p.add_argument("path", help="run directory (or one of its checkpoint directories)")
    p.add_argument("--input", required=True, help="data file (HDF5, or a directory of .npy)")
    p.add_argument("--output", required=True, help="HDF5 file to write (dataset 'prediction')")
    p.add_argument("--rollout", type=int, default=1, metavar="N",
                   help="feed predictions back as input for N steps, keeping every step")
    p.add_argument("--split", default="test",
                   help="the {split} of the task's dataset paths in the input file")
    p.add_argument("--dataset", default=None, help="the input's dataset path in the file")
    p.add_argument("--batch-size", type=int, default=None,
                   help="examples per batch (default: train.batch_size)")
    p.add_argument("--step", type=int, default=None, help="committed step (default: newest)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="changes to the run's config (e.g. mesh.strategy)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from spmd.inference.loading import load_for_job
    from spmd.inference.prediction import predict_file
    from spmd.launch import shutdown

    trained, env = load_for_job(args.path, args.step, args.overrides)
    try:
        done = predict_file(trained, args.input, args.output, split=args.split,
                            dataset=args.dataset, rollout=args.rollout,
                            batch_size=args.batch_size)
    finally:
        if env.size > 1:
            shutdown()
    if env.rank == 0:
        print(f"wrote {done.output}: prediction {done.shape} from {done.input}:{done.dataset} "
              f"({trained.source}) in {done.seconds:.1f} s")
    return 0
