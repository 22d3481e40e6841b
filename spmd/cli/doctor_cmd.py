"""`spmd doctor [CONFIG] [key=value ...] [--json] [--connect]`: what the launcher resolved here.

Every LaunchEnv value with the variable it came from, the devices this rank would drive and
the coordinator it would use, without starting a multi-process JAX backend. `--connect` goes
further: it bootstraps jax.distributed (all ranks must run it) and lists the global devices.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from typing import Any


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="show what the launcher resolved on this rank, and why")
    p.add_argument("config", nargs="?", help="YAML config (for its launch.* timeouts)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    p.add_argument("--json", action="store_true", help="one JSON object per rank on stdout")
    p.add_argument("--connect", action="store_true",
                   help="also run jax.distributed.initialize and list the global devices")
    p.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="seconds to wait for other ranks (default: launch.init_timeout_s)")
    p.set_defaults(func=run)


def _jax_report() -> dict[str, Any]:
    """The backend JAX started here: its platform and the plugin's own version string (the
    CUDA or ROCm release it was built for), and the devices."""
    import jax

    device = jax.devices()[0]
    try:
        platform_version = device.client.platform_version
    except AttributeError:                          # a backend without the attribute
        platform_version = None
    return {"version": jax.__version__, "process_index": jax.process_index(),
            "process_count": jax.process_count(), "device_count": jax.device_count(),
            "local_devices": [str(d) for d in jax.local_devices()],
            "platform": device.platform, "platform_version": platform_version,
            "device_kind": device.device_kind}


def _report(args: argparse.Namespace) -> dict[str, Any]:
    from spmd.config.load import load_config
    from spmd.launch import bootstrap, coordinator, devices, jax_stack, mpi
    from spmd.launch.env import resolve_launch_env
    from spmd.launch.errors import LaunchError
    from spmd.launch.huge_pages import malloc_report
    from spmd.launch.launch_config import LaunchConfig

    launch_cfg = load_config(args.config, args.overrides).launch if args.config else LaunchConfig()
    timeout = args.timeout or launch_cfg.init_timeout_s
    problems: list[str] = []
    if args.connect:
        env = bootstrap(timeout, launch_cfg.heartbeat_timeout_s)
        comm = mpi.world()
    else:
        comm = mpi.world()
        env = resolve_launch_env(os.environ, comm, timeout_s=timeout)
        try:
            addr, source = coordinator.choose(env, comm, os.environ, timeout)
            env = replace(env, coordinator=addr, sources={**env.sources, "coordinator": source})
        except LaunchError as e:
            problems.append(str(e))
    report: dict[str, Any] = env.to_dict()
    report["mpi"] = {"used": comm is not None, "why": mpi.why(),
                     "size": comm.Get_size() if comm is not None else None}
    try:
        plan = devices.plan(env)
        report["devices"] = plan.to_dict()
    except LaunchError as e:
        plan = None
        problems.append(str(e))
    if args.connect or (env.size == 1 and plan is not None):
        if not args.connect:
            devices.apply(plan)
        report["jax"] = _jax_report()
    report["launch_config"] = launch_cfg.model_dump()
    report["malloc"] = malloc_report(os.environ)
    stack = jax_stack.installed()
    report["stack"] = stack.to_dict()
    report["warnings"] = list(stack.warnings)
    report["problems"] = problems
    report["notes"] = _mpi_notes(env.launcher)
    return report


OPEN_MPI_NOTE = (
    "Open MPI: mpirun SIGKILLs the ranks 1 s after it passes on a SIGTERM "
    "(odls_base_sigkill_timeout), too soon for a preemption save, and exits 1. With a bare "
    "mpirun, pass `--mca odls_base_sigkill_timeout S` (S = checkpoint.timeout_s + 30) and "
    "preempt with SIGUSR1 (forwarded; the ranks save and exit 75). `spmd run` does both "
    "(SPMD_MPIEXEC=mpirun selects it).")


def _mpi_notes(launcher: str) -> list[str]:
    """What a user of this MPI's own launcher must know (the launcher `spmd run` would use,
    or the one that started this rank)."""
    from spmd.cli.run_cmd import find_mpiexec, mpi_flavor
    from spmd.errors import SpmdError

    try:
        flavor = mpi_flavor(find_mpiexec())
    except SpmdError:
        flavor = None
    return [OPEN_MPI_NOTE] if "openmpi" in (launcher, flavor) else []


def _human(report: dict[str, Any]) -> str:
    sources = report["sources"]

    def row(key: str, value: object, source: str) -> str:
        return f"  {key:<14} {str(value):<22} <- {source}"

    lines = [f"spmd doctor: rank {report['rank']} of {report['size']} on {report['hostname']}"]
    for key in ("launcher", "rank", "size", "local_rank", "local_size", "node_id", "num_nodes",
                "hostname", "job_id", "restart_count", "coordinator"):
        lines.append(row(key, report[key], sources.get(key, "")))
    lines.append(row("node_of_rank", str(report["node_of_rank"])[:60],
                     sources.get("node_of_rank", "")))
    lines.append(row("mpi", "yes" if report["mpi"]["used"] else "no", report["mpi"]["why"]))
    dev = report.get("devices")
    if dev:
        what = (f"cpu x {dev['cpu_devices'] or 1}" if dev["platform"] == "cpu"
                else f"gpu ids {dev['local_device_ids']}")
        lines.append(row("devices", what, dev["reason"]))
    malloc = report["malloc"]
    lines.append(row("malloc", malloc["glibc_tunables"] or "glibc's defaults",
                     f"GLIBC_TUNABLES; kernel THP {malloc['transparent_hugepage'] or 'unknown'}"))
    stack = report["stack"]
    versions = ", ".join(f"{name} {v or '-'}" for name, v in stack["versions"].items())
    lines.append(row("stack", f"python {stack['python']}", versions))
    plugins = ", ".join(f"{name} {v}" for name, v in stack["plugins"].items())
    lines.append(row("plugin", plugins or "none", "PJRT plugins installed (none: CPU only)"))
    if "jax" in report:
        j = report["jax"]
        lines.append(f"  {'jax':<14} {j['version']}: process {j['process_index']} of "
                     f"{j['process_count']}, {j['device_count']} devices, "
                     f"local {j['local_devices']}")
        lines.append(row("backend", j["platform"], f"{j['device_kind']}; "
                                                   f"{j['platform_version'] or 'no version'}"))
    lines += [f"  warning: {warning}" for warning in report.get("warnings", [])]
    lines += [f"  problem: {problem}" for problem in report["problems"]]
    lines += [f"  note: {note}" for note in report.get("notes", [])]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    report = _report(args)
    # One write per rank, so that ranks under mpiexec/srun do not interleave within a line.
    sys.stdout.write(json.dumps(report) + "\n" if args.json else _human(report))
    sys.stdout.flush()
    return 1 if report["problems"] else 0
