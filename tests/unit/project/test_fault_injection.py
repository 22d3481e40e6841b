"""Fault injection lives in tests/helpers/fault_injection.py alone, and it switches on."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.helpers.env import REPO, clean_env
from tests.helpers.fault_injection import FAIL_HOST_COPY, STALL, fault_env

PRODUCTION = ("spmd", "launch", "sharding", "models", "jobscripts")
TEST_VARIABLE = re.compile(r"SPMD_\w*TEST\w*")

PROBE = """
import sys
early = "jax" in sys.modules
import spmd.checkpoint.local as local, spmd.checkpoint.snapshot as snapshot
print(early, getattr(local.LocalTier._write_own, "fault", None),
      getattr(snapshot.Snapshot.pieces, "fault", None))
from types import SimpleNamespace as NS
if hasattr(snapshot.Snapshot.pieces, "fault"):
    try:
        snapshot.Snapshot.pieces(NS(step=5, owner=NS(rank=1)), [])
    except RuntimeError as e:
        print(e)
"""


def test_no_production_module_reads_a_test_variable():
    offenders = [f"{path.relative_to(REPO)}:{n}: {m.group(0)}"
                 for folder in PRODUCTION for path in sorted((REPO / folder).rglob("*"))
                 if path.is_file() and path.suffix in (".py", ".j2", ".sh")
                 for n, line in enumerate(path.read_text().splitlines(), 1)
                 for m in TEST_VARIABLE.finditer(line)]
    assert not offenders, offenders


def _probe(**faults: str) -> list[str]:
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                       cwd=REPO, env=clean_env(**fault_env(**faults)), timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.splitlines()


def test_fault_env_switches_the_faults_on_in_a_child_without_importing_early():
    env = fault_env(stall="3:1", fail_host_copy="5:1")
    assert env[STALL] == "3:1" and env[FAIL_HOST_COPY] == "5:1"
    assert env["PYTHONPATH"].split(os.pathsep)[0].endswith("tests/helpers/inject")
    assert _probe(stall="3:1", fail_host_copy="5:1") == [
        f"False {STALL} {FAIL_HOST_COPY}", f"{FAIL_HOST_COPY}: injected failure"]


def test_without_faults_nothing_is_wrapped():
    assert fault_env() == {}
    assert _probe() == ["False None None"]
