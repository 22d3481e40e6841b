"""The arguments every command on a trained run takes: its path, a step, config overrides."""

from __future__ import annotations

import argparse


def add_trained_run_arguments(p: argparse.ArgumentParser) -> None:
    """PATH (a run directory or one of its checkpoint directories) and --step; a command's
    own positionals follow, then `add_overrides_argument`."""
    p.add_argument("path", help="run directory (or one of its checkpoint directories)")
    p.add_argument("--step", type=int, default=None, help="committed step (default: newest)")


def add_overrides_argument(p: argparse.ArgumentParser) -> None:
    """The trailing `key=value ...` changes to the run's config (the last positional)."""
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="changes to the run's config (e.g. a moved data.path, mesh.strategy)")
