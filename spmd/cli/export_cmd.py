"""`spmd export PATH OUT [--step N] [--platform P ...]`: a run's prediction function with its
trained parameters as a jax.export (StableHLO) artifact, plus a Flax-restorable parameters
checkpoint (spmd.inference.exporting). One process; the model is loaded onto one device."""

from __future__ import annotations

import argparse

from spmd.cli.main import JAX_STACK
from spmd.cli.trained_args import add_overrides_argument, add_trained_run_arguments

# what run() imports, loaded by spmd.cli.main with the garbage collector off (load_stack)
STACK = (*JAX_STACK, "spmd.inference.exporting", "spmd.inference.loading")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="export a run's model as StableHLO plus its parameters")
    add_trained_run_arguments(p)
    p.add_argument("out", help="new directory for predict.jax, params/ and export.json")
    p.add_argument("--platform", action="append", default=None, dest="platforms",
                   help="lower for this platform (cpu, cuda, rocm; repeatable; default: this "
                        "machine's)")
    add_overrides_argument(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from spmd.inference.exporting import export_model
    from spmd.inference.loading import load

    trained = load(args.path, args.step, overrides=args.overrides)
    done = export_model(trained, args.out, platforms=args.platforms)
    print(f"wrote {done.out_dir}: predict.jax ({done.bytes:,} bytes; input "
          f"{done.input_name} {list(done.input_shape)} {done.input_dtype}, platforms "
          f"{', '.join(done.platforms)}), params/ ({trained.source})")
    return 0
