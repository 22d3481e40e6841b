"""Several `spmd` commands in one Python process, each in its own environment.

A process start imports spmd's config (and so jax): about 3 s of CPU on the loaded CI
machine, more than a failing command or a multi-rank `spmd doctor` (which resolves the launch
from os.environ alone) takes to run. Tests that check many such commands run them through
this helper in one child process (tests/unit/launch/test_launch_resolve.py,
tests/unit/cli/test_cli_errors.py).

    python -m tests.helpers.cli_batch < cases.json   # [{"env": {...}, "args": [...]}, ...]

prints one JSON list: per case its returncode, stdout and stderr, with a traceback (if any)
in that case's stderr, as the command line would print it. Every case must set SPMD_MPI=0:
`spmd.launch.mpi.world()` caches its answer for the process. JAX starts at most once per
process, so cases that start it must agree on JAX_* (the number of CPU devices).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import traceback
from types import SimpleNamespace


def run_case(env: dict[str, str], args: list[str]) -> dict:
    """`spmd ARGS` in this process with os.environ replaced by `env`."""
    if env.get("SPMD_MPI") != "0":
        raise ValueError("cli_batch cases need SPMD_MPI=0 (mpi.world() is cached)")
    os.environ.clear()
    os.environ.update(env)
    from spmd.cli.main import main  # first import (and jax's) under the first case's env
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(args)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
            code = 1
    return {"returncode": code, "stdout": out.getvalue(), "stderr": err.getvalue()}


def run_batch(cases: list[tuple[dict[str, str], list[str]]],
              timeout: float = 300) -> list[SimpleNamespace]:
    """Run `cases`, (environment, spmd arguments) pairs, in one child process: per case a
    result with returncode, stdout and stderr (as subprocess.run's)."""
    import subprocess

    from tests.helpers.env import REPO, clean_env

    proc = subprocess.run([sys.executable, "-m", "tests.helpers.cli_batch"],
                          input=json.dumps([{"env": env, "args": args} for env, args in cases]),
                          capture_output=True, text=True, env=clean_env(SPMD_MPI="0"),
                          timeout=timeout, cwd=REPO)
    if proc.returncode != 0 or "Traceback" in proc.stderr:
        raise RuntimeError(f"tests.helpers.cli_batch failed:\n{proc.stderr[-4000:]}")
    results = json.loads(proc.stdout.splitlines()[-1])
    return [SimpleNamespace(**r) for r in results]


def main() -> int:
    cases = json.load(sys.stdin)
    saved = dict(os.environ)
    results = [run_case(c["env"], c["args"]) for c in cases]
    os.environ.clear()
    os.environ.update(saved)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
