"""`spmd plan CONFIG --devices N [--system S] [--json] [key=value ...]`: compile ahead of time.

Lowers and compiles the train step for a mesh of N devices and reports per-device memory,
FLOPs and collectives; exits 3 when the step does not fit the system's device memory.
With an NVIDIA `--system` on a machine with one NVIDIA GPU, it compiles with the GPU
compiler for N of the profile's GPUs (an abstract CUDA topology); elsewhere for N CPU
stand-ins, so a laptop can plan for 512 GPUs. The output's `compiler` says which.
"""

from __future__ import annotations

import argparse
import json

# what run() imports, loaded by spmd.cli.main with the garbage collector off (load_stack)
STACK = ("jax", "jax.numpy", "flax.nnx", "spmd.aot.plan", "spmd.config.load")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="compile ahead of time: per-device memory, FLOPs, "
                                    "collectives, and whether it fits")
    p.add_argument("config", help="YAML config file")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    p.add_argument("--devices", type=int, required=True,
                   help="plan for N devices (N abstract GPUs of an NVIDIA --system when a GPU "
                        "is visible, else N CPU stand-ins)")
    p.add_argument("--system", default=None,
                   help="system profile whose device memory to check against "
                        "(default: a generic 80 GB GPU)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from spmd.aot.plan import make_plan, target_memory
    from spmd.aot.topologies import plan_devices
    from spmd.config.load import load_config

    cfg = load_config(args.config, args.overrides)
    target_memory(args.system)  # a bad --system fails before any compilation
    chosen = plan_devices(args.devices, args.system)
    from spmd.engine.mesh import build_mesh

    mesh = build_mesh(cfg.mesh, chosen.devices)
    plan = make_plan(cfg, mesh, args.system, config_name=str(args.config),
                     compiler_note=chosen.note)
    print(json.dumps(plan.as_json(), indent=2) if args.json else plan.as_text())
    plan.check_fits()
    return 0
