"""Several `spmd doctor` commands in one Python process, each in its own environment.

`spmd doctor` without `--connect` and for more than one rank resolves the launch from
os.environ alone (no JAX backend, no MPI with SPMD_MPI=0), but a process start imports spmd's
config (and so jax): about 3 s of CPU each. tests/unit/test_launch_resolve.py runs its cases
through this helper in one child process instead of one child each.

    python -m tests.helpers.doctor_batch < cases.json   # [{"env": {...}, "args": [...]}, ...]

prints one JSON list: per case its returncode, stdout and stderr, with a traceback (if any)
in that case's stderr, as the command line would print it. Every case must set SPMD_MPI=0:
`spmd.launch.mpi.world()` caches its answer for the process.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import traceback


def run_case(env: dict[str, str], args: list[str]) -> dict:
    """`spmd ARGS` in this process with os.environ replaced by `env`."""
    from spmd.cli.main import main

    if env.get("SPMD_MPI") != "0":
        raise ValueError("doctor_batch cases need SPMD_MPI=0 (mpi.world() is cached)")
    os.environ.clear()
    os.environ.update(env)
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
