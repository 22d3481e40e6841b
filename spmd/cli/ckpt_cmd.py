"""`spmd ckpt ls RUN_DIR` / `spmd ckpt verify RUN_DIR`: checkpoints in every tier, and integrity.

`verify` exits 1 when a file fails its checksum or a step's manifest (persistent) or a rank
copy's marker (local) does not read (one DAMAGED line each, naming the step), or a committed
step's parameters hold NaN/Inf (one NON-FINITE line per step and parameter, with the count).
`ls` shows the same states, one word each (spmd.checkpoint.listing; docs/checkpointing.md).

Both read RUN_DIR/config.yaml for the tier directories (defaults: RUN_DIR/local and
RUN_DIR/checkpoints). A node-local tier on another node is not visible from here: run these on
the node (e.g. inside the allocation: `srun --ntasks-per-node=1 spmd ckpt ls RUN_DIR`) to see
it. Each rank copy names the host that committed it, and `ls` names the host it runs on, so
the listings of several nodes say which node holds what.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
from pathlib import Path

from spmd.errors import SpmdError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ckpt", help="list and verify a run's checkpoints (local and persistent)")
    csub = p.add_subparsers(dest="ckpt_command", required=True)
    ls = csub.add_parser("ls", help="steps per tier: committed or not, sizes, partner copies")
    ls.add_argument("run_dir", type=Path, help="the run directory (holds config.yaml)")
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    ver = csub.add_parser("verify", help="recompute every checksum and look for NaN/Inf in "
                          "the parameters; non-zero exit on damage or non-finite parameters")
    ver.add_argument("run_dir", type=Path, help="the run directory (holds config.yaml)")
    ver.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def _sections(run_dir: Path):
    """The run's `run` and `checkpoint` sections from its config.yaml (run.dir taken as
    RUN_DIR), read without importing its task (`load_run_sections`)."""
    from spmd.config.load import load_run_sections

    config = run_dir / "config.yaml"
    if not config.is_file():
        raise SpmdError(f"{config} does not exist: RUN_DIR must be a run directory written by "
                        "`spmd train` (it holds config.yaml)")
    sections = load_run_sections(config)
    return sections.run.model_copy(update={"dir": run_dir}), sections.checkpoint


def tiers(run_dir: Path) -> tuple[Path, Path]:
    """(local_dir, persistent_dir) of a run, from its config.yaml (run.dir taken as RUN_DIR)."""
    from spmd.checkpoint.policy import tier_dirs

    run, checkpoint = _sections(run_dir)
    return tier_dirs(checkpoint, run.dir)


def run(args: argparse.Namespace) -> int:
    return _ls(args) if args.ckpt_command == "ls" else _verify(args)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _ls(args: argparse.Namespace) -> int:
    from spmd.checkpoint.listing import as_dict, scan_local, scan_persistent
    from spmd.checkpoint.policy import tier_dirs
    from spmd.rundir.lease import LEASE_NAME, inspect_lease

    run_cfg, checkpoint = _sections(args.run_dir)
    local_dir, persistent_dir = tier_dirs(checkpoint, run_cfg.dir)
    stale_s = run_cfg.lease_stale_s
    lease = inspect_lease(args.run_dir, stale_s)
    local, persistent = scan_local(local_dir), scan_persistent(persistent_dir)
    latest_local = max((s.step for s in local if s.committed), default=None)
    latest_persistent = max((s.step for s in persistent if s.state == "committed"), default=None)
    if args.json:
        print(json.dumps({"host": socket.gethostname(), "local_dir": str(local_dir),
                          "persistent_dir": str(persistent_dir),
                          "local": [as_dict(s) for s in local],
                          "persistent": [as_dict(s) for s in persistent],
                          "latest": {"local": latest_local, "persistent": latest_persistent},
                          "lease": lease.to_dict() if lease else None}, indent=1))
        return 0
    print(f"lease: {args.run_dir / LEASE_NAME}: "
          + (lease.describe(stale_s) if lease else "none (no run is writing here)"))
    print(f"local tier: {local_dir} on {socket.gethostname()}"
          + ("" if local_dir.is_dir() else "  (not visible here)"))
    for s in local:
        state = "committed" if s.committed else "NOT committed"
        total = sum(c.bytes for c in s.ranks)
        print(f"  step {s.step:>8}  {state:<13}  {_size(total):>10}  "
              f"{len(s.ranks)} rank copies" + (f" of {s.num_processes}" if s.num_processes else ""))
        for c in s.ranks:
            held = (f", holds partner copies of rank(s) {', '.join(map(str, c.partners))}"
                    if c.partners else "")
            why = f"  ({c.problem})" if c.problem else ""
            on = f" on {c.host}" if c.host else ""
            print(f"      rank {c.rank:<5} {c.state:<9} {_size(c.bytes):>10}{on}{held}{why}")
    print(f"persistent tier: {persistent_dir}"
          + ("" if persistent_dir.is_dir() else "  (does not exist)"))
    for p in persistent:
        why = f"  ({p.problem}; see `spmd ckpt verify`)" if p.problem else ""
        print(f"  step {p.step:>8}  {p.state:<13}  {_size(p.bytes):>10}  {p.files} files{why}")
    print(f"latest committed: local {latest_local}, persistent {latest_persistent}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    from spmd.checkpoint.listing import (
        nonfinite_persistent_steps,
        nonfinite_text,
        verify_local,
        verify_persistent,
    )

    local_dir, persistent_dir = tiers(args.run_dir)
    nonfinite: list[dict] = []
    local_problems, local_checked = verify_local(local_dir, nonfinite)
    pers_problems, pers_checked = verify_persistent(persistent_dir)
    pers_nonfinite, unreadable = nonfinite_persistent_steps(persistent_dir)
    nonfinite += pers_nonfinite
    problems = local_problems + pers_problems + unreadable
    if args.json:
        print(json.dumps({"ok": not problems and not nonfinite, "problems": problems,
                          "nonfinite": nonfinite,
                          "checked": {"local": local_checked, "persistent": pers_checked}},
                         indent=1))
    else:
        print(f"local tier {local_dir}: {local_checked} files checked, "
              f"{len(local_problems)} damaged")
        print(f"persistent tier {persistent_dir}: {pers_checked} files checked, "
              f"{len(pers_problems)} damaged")
        for p in problems:
            print(f"DAMAGED: {p}", file=sys.stderr)
        for r in nonfinite:
            print(f"NON-FINITE: {nonfinite_text(r)}", file=sys.stderr)
    return 1 if problems or nonfinite else 0
