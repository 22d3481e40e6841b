"""The `spmd` command's start-up (spmd.cli.main.load_stack): each command's STACK is
importable (a renamed module would be skipped silently and its import would run with the
collector on), and main() hands the command a collector that is on, with the start-up
frozen, whether the command line parses or not."""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys

from spmd.cli.main import COMMANDS
from tests.helpers.env import clean_env


def test_every_command_stack_names_modules_that_exist():
    stacks = {name: getattr(importlib.import_module(f"spmd.cli.{name}_cmd"), "STACK", ())
              for name in COMMANDS}
    assert "spmd.api" in stacks["train"] and "orbax.checkpoint" in stacks["eval"]
    for name, stack in stacks.items():
        for module in stack:
            assert importlib.util.find_spec(module) is not None, (name, module)


PROBE = """
import gc, sys
from spmd.cli.main import main
try:
    code = main(sys.argv[1:])
except SystemExit as e:
    code = e.code
print(code, gc.isenabled(), gc.get_freeze_count() > 1000)
"""


def test_the_collector_is_on_and_the_start_up_frozen_when_the_command_runs(tmp_path):
    for argv, expected in ((["report", str(tmp_path / "no_run")], "2"), (["nonsense"], "2")):
        r = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True,
                           text=True, env=clean_env(), timeout=120)
        assert r.stdout.split() == [expected, "True", "True"], (argv, r.stdout, r.stderr)
