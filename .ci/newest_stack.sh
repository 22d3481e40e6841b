#!/usr/bin/env bash
# The newest supported stack, beside the default one that the README's test command tests:
# Python 3.13 (the newest interpreter pyenv has here) in a venv of its own, spmd installed with
# exactly the versions of constraints/py313.txt (jax 0.12, flax 0.12.12, zarr 3.4, numpy 2.5),
# then the fast tier and a multi-process smoke test (2 ranks under the mpich wheel's mpiexec).
# Usage: bash .ci/newest_stack.sh   (SPMD_NEWEST_PYTHON=/path/to/python3.13 to choose one)
set -euo pipefail
cd "$(dirname "$0")/.."

# pyenv's own interpreters first: its python3.13 shim on PATH fails unless 3.13 is selected
python=${SPMD_NEWEST_PYTHON:-}
if [[ -z "$python" ]]; then
    for candidate in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.13*/bin/python3.13 \
                     "$(command -v python3.13 || true)"; do
        if [[ -x "$candidate" ]] && "$candidate" -c \
                'import sys; sys.exit(sys.version_info[:2] != (3, 13))' 2>/dev/null; then
            python=$candidate
            break
        fi
    done
fi
if [[ -z "$python" ]]; then
    echo "newest stack: no Python 3.13 here (set SPMD_NEWEST_PYTHON to one)" >&2
    # CI must run it; a developer's machine without 3.13 skips it, and says so
    if [[ "${CI:-}" == "true" ]]; then exit 1; fi
    exit 0
fi

venv=$(mktemp -d "${TMPDIR:-/tmp}/spmd-newest-stack.XXXXXX")
trap 'rm -rf "$venv"' EXIT
started=$SECONDS
"$python" -m venv "$venv"
"$venv/bin/python" -m pip install -q -e '.[local,dev]' -c constraints/py313.txt
echo "newest stack: $("$venv/bin/python" -c 'import sys, jax, flax, zarr, numpy;
print(f"python {sys.version.split()[0]}, jax {jax.__version__}, flax {flax.__version__}, "
      f"zarr {zarr.__version__}, numpy {numpy.__version__}")') (installed in $((SECONDS - started)) s)"
# the venv's bin is not on PATH, as for a user who calls its python by path: every test finds
# the mpich wheel's mpiexec beside the interpreter
"$venv/bin/python" -m pytest -m "not slow" -p no:cacheprovider -q --durations=10
"$venv/bin/python" -m pytest -p no:cacheprovider -q --durations=5 -n 0 \
    tests/multiprocess/test_multiprocess.py::test_two_processes_match_one_process
echo "newest stack: done in $((SECONDS - started)) s"
