"""`spmd predict PATH --input FILE --output OUT [--format hdf5|zarr|netcdf] [--rollout N]`: a
run's model over every example of a data file, written to HDF5 or, for an OUT ending in
.zarr (or --format zarr), a Zarr v3 store, or, for a run on gridded files and an OUT ending
in .nc, a NetCDF forecast with its coordinates (spmd.inference.prediction); one process, or
every rank under `spmd run -n N --entry predict PATH -- --input ...`."""

from __future__ import annotations

import argparse

from spmd.cli.main import JAX_STACK
from spmd.cli.trained_args import add_overrides_argument, add_trained_run_arguments

# what run() imports, loaded by spmd.cli.main with the garbage collector off (load_stack)
STACK = (*JAX_STACK, "spmd.inference.loading", "spmd.inference.outputs",
         "spmd.inference.prediction")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("predict", help="predict with a run's trained model over a data file")
    add_trained_run_arguments(p)
    p.add_argument("--input", required=True,
                   help="data file (HDF5, NetCDF4, a Zarr store or a directory of .npy)")
    p.add_argument("--output", required=True,
                   help="HDF5 file, or Zarr store for a name ending in .zarr, to write "
                        "(dataset 'prediction'); for a run on gridded files, a NetCDF "
                        "forecast with its coordinates for a name ending in .nc")
    p.add_argument("--format", default=None, metavar="{hdf5,zarr,netcdf}",
                   help="output format (default: zarr for an --output ending in .zarr, "
                        "netcdf for .nc, else hdf5)")
    p.add_argument("--rollout", type=int, default=1, metavar="N",
                   help="feed predictions back as input for N steps, keeping every step")
    p.add_argument("--split", default="test",
                   help="the {split} of the task's dataset paths in the input file; for a "
                        "run on gridded files, the split of data.splits whose windows to "
                        "predict (all: every window of the files)")
    p.add_argument("--dataset", default=None, help="the input's dataset path in the file")
    p.add_argument("--batch-size", type=int, default=None,
                   help="examples per batch (default: train.batch_size)")
    add_overrides_argument(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from spmd.inference.loading import trained_job
    from spmd.inference.outputs import output_format
    from spmd.inference.prediction import predict_file

    output_format(args.output, args.format)   # a wrong --format fails before any loading
    with trained_job(args.path, args.step, args.overrides) as (trained, env):
        done = predict_file(trained, args.input, args.output, split=args.split,
                            dataset=args.dataset, rollout=args.rollout,
                            batch_size=args.batch_size, format=args.format)
    if env.rank == 0:
        print(f"wrote {done.output} ({done.format}): prediction {done.shape} from "
              f"{done.input}:{done.dataset} ({trained.source}) in {done.seconds:.1f} s")
    return 0
