"""`spmd plan CONFIG --devices N [--system S] [--json] [key=value ...]`: compile ahead of time.

Lowers and compiles the train step for a mesh of N devices (CPU stand-ins, so a laptop
can plan for 512 GPUs) and reports per-device memory, FLOPs and collectives; exits 3
when the step does not fit the system's device memory.
"""

from __future__ import annotations

import argparse
import json


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="compile ahead of time: per-device memory, FLOPs, "
                                    "collectives, and whether it fits")
    p.add_argument("config", help="YAML config file")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    p.add_argument("--devices", type=int, required=True,
                   help="plan for N devices (simulated with N CPU devices)")
    p.add_argument("--system", default=None,
                   help="system profile whose device memory to check against "
                        "(default: a generic 80 GB GPU)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from spmd.config import load_config
    from spmd.plan import make_plan, target_memory
    from spmd.stand_in_devices import cpu_stand_in_devices

    cfg = load_config(args.config, args.overrides)
    target_memory(args.system)  # a bad --system fails before any compilation
    devices = cpu_stand_in_devices(args.devices)
    from spmd.mesh import build_mesh

    mesh = build_mesh(cfg.mesh, devices)
    plan = make_plan(cfg, mesh, args.system, config_name=str(args.config))
    print(json.dumps(plan.as_json(), indent=2) if args.json else plan.as_text())
    plan.check_fits()
    return 0
