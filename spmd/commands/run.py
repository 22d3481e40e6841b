"""`spmd run -n N CONFIG [key=value ...] [--ppn P]`: a local multi-process job through MPI.

Starts N ranks of `spmd train CONFIG ...` with the installed MPI's mpiexec (the mpich wheel's
from `pip install 'spmd-hpc[local]'`, next to this Python or on PATH). Every P consecutive
ranks stand for one node (SPMD_PROCESSES_PER_NODE, default 1), so a single machine exercises
inter-node mesh factors and partner checkpoints. SIGTERM/SIGINT/SIGUSR1/SIGUSR2 are forwarded
to mpiexec, which forwards them to the ranks; the exit status is the ranks' (75 = preempted).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from spmd.errors import SpmdError

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)
# Per-rank variables an outer launcher may have left; inherited, they would make every local
# rank claim the same identity.
_STALE_PREFIXES = ("SLURM_STEP_", "JSM_NAMESPACE_", "PALS_", "OMPI_COMM_WORLD_", "PMI_", "PMIX_",
                   "FLUX_TASK_")
_STALE_NAMES = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_STEPID", "MPI_LOCALRANKID",
                "MPI_LOCALNRANKS", "SPMD_RANK", "SPMD_SIZE", "SPMD_LOCAL_RANK",
                "SPMD_LOCAL_SIZE", "SPMD_NODE_ID", "JAX_PROCESS_ID", "JAX_NUM_PROCESSES",
                "JAX_COORDINATOR_ADDRESS", "JAX_LOCAL_DEVICE_IDS")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="run N local ranks of `spmd train` through the installed MPI")
    p.add_argument("-n", "--np", dest="n", type=int, required=True, metavar="N",
                   help="number of ranks")
    p.add_argument("--ppn", type=int, default=1, metavar="P",
                   help="ranks that stand for one node (default 1: every rank its own node)")
    p.add_argument("--entry", default="train", help=argparse.SUPPRESS)  # subcommand per rank
    p.add_argument("config", help="YAML config file")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    p.set_defaults(func=run)


def find_mpiexec() -> Path:
    """mpiexec next to this Python (a venv with the mpich wheel), else on PATH."""
    here = Path(sys.executable).parent / "mpiexec"
    if here.is_file() and os.access(here, os.X_OK):
        return here
    found = shutil.which("mpiexec")
    if found:
        return Path(found)
    raise SpmdError(f"spmd run needs an mpiexec, and there is none next to {sys.executable} or "
                    "on PATH: install the embedded MPI with `pip install 'spmd-hpc[local]'` "
                    "(the mpich wheel), or load your site's MPI module")


def flavor_args(mpiexec: Path) -> list[str]:
    """Options that keep a local job on this machine for the MPI at hand."""
    try:
        out = subprocess.run([str(mpiexec), "--version"], capture_output=True, text=True,
                             timeout=20)
        version = out.stdout + out.stderr
    except (OSError, subprocess.SubprocessError) as e:
        raise SpmdError(f"{mpiexec} --version failed ({e}); is this MPI installed correctly?"
                        ) from None
    if "HYDRA" in version:  # MPICH / Intel MPI: fork locally, never via srun or ssh
        return ["-launcher", "fork"]
    if "Open MPI" in version or "OpenRTE" in version or "PRRTE" in version:
        return ["--oversubscribe", "--bind-to", "none"]
    return []


def child_env(ppn: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(_STALE_PREFIXES) and k not in _STALE_NAMES}
    env["SPMD_PROCESSES_PER_NODE"] = str(ppn)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def run(args: argparse.Namespace) -> int:
    if args.n < 1:
        raise SpmdError(f"spmd run: -n {args.n}: need at least one rank")
    if args.ppn < 1 or args.n % args.ppn:
        raise SpmdError(f"spmd run: --ppn {args.ppn} does not divide -n {args.n} into equal nodes")
    mpiexec = find_mpiexec()
    rank_cmd = [sys.executable, "-m", "spmd.cli", *(["--debug"] if args.debug else []),
                args.entry, args.config, *args.overrides]
    cmd = [str(mpiexec), "-n", str(args.n), *flavor_args(mpiexec), *rank_cmd]
    print(f"spmd run: {args.n} ranks, {args.ppn} per node, via {mpiexec}", file=sys.stderr,
          flush=True)
    proc = subprocess.Popen(cmd, env=child_env(args.ppn), start_new_session=True)

    def forward(signum: int, frame: object) -> None:
        try:
            os.killpg(proc.pid, signum)
        except ProcessLookupError:
            pass

    previous = {s: signal.signal(s, forward) for s in FORWARDED}
    try:
        while True:
            try:
                code = proc.wait()
                break
            except KeyboardInterrupt:  # a handler raced us; keep waiting for the ranks
                continue
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return code if code >= 0 else 128 - code
