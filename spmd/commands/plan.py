"""`spmd plan CONFIG --devices N [--system S] [--json] [key=value ...]`: compile ahead of time.

Lowers and compiles the train step for a mesh of N devices (CPU stand-ins, so a laptop
can plan for 512 GPUs) and reports per-device memory, FLOPs and collectives; exits 3
when the step does not fit the system's device memory.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


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


def use_cpu_devices(n: int) -> None:
    """N CPU devices for this process; must happen before JAX starts its backends."""
    from spmd.errors import SpmdError

    if n < 1:
        raise SpmdError(f"--devices {n}: must be at least 1")
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["JAX_NUM_CPU_DEVICES"] = str(n)
    if "jax" in sys.modules:   # imported already (e.g. in-process): configure it directly
        import jax

        try:
            jax.config.update("jax_platforms", "cpu")
            jax.config.update("jax_num_cpu_devices", n)
        except RuntimeError:
            pass  # backends already up: checked below against the devices that exist


def run(args: argparse.Namespace) -> int:
    from spmd.config import load_config
    from spmd.errors import SpmdError
    from spmd.plan import make_plan, target_memory

    cfg = load_config(args.config, args.overrides)
    target_memory(args.system)  # a bad --system fails before any compilation
    use_cpu_devices(args.devices)
    import jax

    from spmd.mesh import build_mesh

    devices = jax.devices()
    if len(devices) < args.devices:
        raise SpmdError(f"--devices {args.devices}: this process already runs JAX with "
                        f"{len(devices)} devices; run `spmd plan` in a fresh process")
    mesh = build_mesh(cfg.mesh, devices[: args.devices])
    plan = make_plan(cfg, mesh, args.system, config_name=str(args.config))
    print(json.dumps(plan.as_json(), indent=2) if args.json else plan.as_text())
    plan.check_fits()
    return 0
