"""The `spmd` console script. Each subcommand lives in `spmd.cli.<name>_cmd`.

A subcommand module provides `register(subparsers)` and `run(args) -> int`.
Errors that a user can fix (SpmdError, ShardingError) print one message and exit
non-zero; the traceback goes to stderr only with --debug. `spmd --version` names this
package's version and those of JAX and Flax it runs with.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import logging
import platform
import sys
import traceback

from spmd.comm.job_failure import announced, end_process
from spmd.errors import ExitCode, SpmdError
from spmd.launch import liveness

DISTRIBUTION = "spmd-hpc"
COMMANDS = ("train", "run", "doctor", "shardings", "optimizer", "jobscript", "ckpt", "plot",
            "data", "plan", "profile", "report", "eval", "predict", "export")

log = logging.getLogger("spmd")


def version_text() -> str:
    """"spmd 0.1.0 (jax 0.7.0, jaxlib 0.7.0, flax 0.11.0, Python 3.11.7)", from the installed
    distributions' metadata (nothing is imported)."""
    def version(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    own = version(DISTRIBUTION) or "(not installed: run from a source tree)"
    others = [f"{name} {v}" for name in ("jax", "jaxlib", "flax") if (v := version(name))]
    return f"spmd {own} ({', '.join([*others, f'Python {platform.python_version()}'])})"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spmd", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    parser.add_argument("--version", action="version", version=version_text(),
                        help="print the versions of spmd, JAX and Flax, and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(f"spmd.cli.{name}_cmd").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    liveness.start_from_env()   # a rank under the recovery supervisor beats from now on
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # `key=value` overrides may follow options (`spmd shardings C --json mesh.strategy=tp`).
    stray = [a for a in extra if a.startswith("-") or "=" not in a]
    if stray or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    try:
        code = args.func(args)
    except SpmdError as e:
        if args.debug:
            traceback.print_exc()
        if announced() is None:  # a failed rank of a job logged it already, with rank and host
            print(f"spmd {args.command}: error: {e}", file=sys.stderr)
        code = e.exit_code
    except KeyboardInterrupt:
        code = ExitCode.INTERRUPTED
    except BaseException:
        if announced() is None:
            raise
        code = announced()  # logged with its traceback by the rank (spmd.loop.trainer)
    if announced() is not None:
        # a failed rank of a multi-process job: JAX's exit handler would wait for the other
        # ranks in the shutdown barrier, and they are gone (spmd.comm.job_failure)
        end_process(int(code or 1))
    return int(code or 0)

