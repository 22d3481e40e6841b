"""The `spmd` console script. Each subcommand lives in `spmd.cli.<name>_cmd`.

A subcommand module provides `register(subparsers)` and `run(args) -> int`, and, when its
run() imports JAX, `STACK`: the modules run() imports first. main() loads them with Python's
cyclic garbage collector off, then freezes what is loaded (`load_stack`).
Errors that a user can fix (SpmdError, ShardingError) print one message and exit
non-zero; the traceback goes to stderr only with --debug. `spmd --version` names this
package's version and those of JAX and Flax it runs with.
"""

from __future__ import annotations

import argparse
import gc
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


# What every command that runs JAX imports: part of each such command's STACK.
JAX_STACK = ("jax", "jax.numpy", "flax.nnx", "optax", "orbax.checkpoint")


def load_stack(command: str) -> None:
    """Import `command`'s STACK, the modules its run() imports first. main() calls it with the
    cyclic garbage collector off, and freezes what is loaded before it turns the collector
    back on.

    Why: JAX, Flax, Optax, Orbax and spmd load hundreds of thousands of long-lived objects,
    and the collector walked all of them at each of its full passes, while they loaded and
    then through tracing and compiling; frozen, they are left out. A small rank's CPU from
    start to end went from 3.8-4.0 to 2.8-3.3 s (2026-11-30, 2 cores, `spmd train
    configs/mlp_tiny.yaml`, 3 runs each; the collector off while importing, but nothing
    frozen: 3.5-3.9 s). Every rank of a job, and each new try of a recovery, pays it. An
    import that fails is left to run(), which reports it where it belongs."""
    for name in getattr(importlib.import_module(f"spmd.cli.{command}_cmd"), "STACK", ()):
        try:
            importlib.import_module(name)
        except ImportError:
            pass


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line, `key=value` overrides included; exits with usage on an error."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # `key=value` overrides may follow options (`spmd shardings C --json mesh.strategy=tp`).
    stray = [a for a in extra if a.startswith("-") or "=" not in a]
    if stray or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    return args


def main(argv: list[str] | None = None) -> int:
    liveness.start_from_env()   # a rank under the recovery supervisor beats from now on
    gc.disable()                # while the command's modules load (load_stack)
    try:
        args = parse(argv)
        load_stack(args.command)
    finally:
        gc.collect()            # one full pass, so that no garbage is frozen
        gc.freeze()
        gc.enable()
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

