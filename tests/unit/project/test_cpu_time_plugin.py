"""tests/helpers/cpu_time.py records each test's CPU seconds, its children's included."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers.env import REPO, clean_env

BUSY_CHILD = """
import subprocess, sys
def test_child_burns_cpu():
    subprocess.run([sys.executable, "-c", "sum(i * i for i in range(3_000_000))"], check=True)
def test_idle():
    pass
"""


def test_the_plugin_logs_cpu_seconds_with_the_childrens(tmp_path):
    (tmp_path / "test_busy.py").write_text(BUSY_CHILD)
    log = tmp_path / "cpu.log"
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p",
                        "tests.helpers.cpu_time", "-p", "no:cacheprovider", "-o", "addopts=",
                        str(tmp_path / "test_busy.py")], cwd=REPO, capture_output=True,
                       text=True, timeout=120,
                       env=clean_env(SPMD_TEST_CPU_LOG=str(log), PYTHONPATH=str(REPO)))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = {line.split()[2].split("::")[1]: float(line.split()[0])
            for line in log.read_text().splitlines()}
    assert set(rows) == {"test_child_burns_cpu", "test_idle"}
    assert rows["test_child_burns_cpu"] > 0.1 > rows["test_idle"]
