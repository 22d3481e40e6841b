"""`spmd.cli` withholds IPython from Flax's import-time probes only (spmd.cli.ipython_probe).

An `IPython` package of the test's own, first on PYTHONPATH, records who imports it: the
image's real IPython need not be installed, and the test does not depend on its version."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers.env import REPO, clean_env

FAKE_IPYTHON = '''
import os, sys
with open(os.environ["IPYTHON_IMPORTED"], "a") as f:
    f.write(sys._getframe(1).f_globals.get("__name__", "?") + "\\n")
if os.environ.get("IPYTHON_FAIL"):   # as if half-installed: the importers' ImportError branch
    raise ImportError("fake IPython")
def get_ipython():
    return None
'''

CHECK = '''
import sys
import spmd.cli                       # installs the finder
import flax.nnx, treescope            # their probes ask for IPython
from flax.nnx import reprlib
assert "IPython" not in sys.modules, "Flax's probes imported IPython"
assert reprlib.supports_color() is False
import IPython                        # a user's own import gets the real module
assert IPython.get_ipython() is None
'''


def test_flax_imports_without_ipython_and_a_users_import_still_gets_it(tmp_path):
    (tmp_path / "IPython").mkdir()
    (tmp_path / "IPython" / "__init__.py").write_text(FAKE_IPYTHON)
    record = tmp_path / "imported.txt"
    env = clean_env(PYTHONPATH=f"{tmp_path}:{REPO}", IPYTHON_IMPORTED=str(record))
    r = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True,
                       timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert record.read_text().count("\n") == 1   # once: the user's import

    # without spmd.cli, Flax imports it (what the finder saves)
    record.unlink()
    r = subprocess.run([sys.executable, "-c", "import flax.nnx"], env={**env, "IPYTHON_FAIL": "1"},
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert record.is_file()
