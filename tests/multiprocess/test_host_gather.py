"""spmd.comm.host_gather with two real ranks: the values JAX's process_allgather gives, and a
job that ends as soon as its ranks are done (nothing of a gather left running)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.helpers.checkpoint_worker import _mpi
from tests.helpers.env import REPO, clean_env

pytestmark = pytest.mark.slow


def test_gather_to_host_matches_process_allgather_and_the_job_ends_at_once(tmp_path):
    """Values and dtypes as JAX's own gather gives them; sync_devices, the trainer's barrier,
    raises on every rank when the ranks pass different names; and the job ends at once."""
    r = subprocess.run([*_mpi(2), sys.executable,
                        str(REPO / "tests" / "helpers" / "gather_worker.py"), str(tmp_path)],
                       capture_output=True, text=True, timeout=300, cwd=REPO,
                       env=clean_env(JAX_NUM_CPU_DEVICES="4", SPMD_PROCESSES_PER_NODE="1",
                                     PYTHONPATH=str(REPO)))
    ended = time.time()
    assert r.returncode == 0, r.stdout + r.stderr
    ranks = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in (0, 1)]
    for got in ranks:
        assert got["ours"]["sharded"][0] == got["whole"]          # a global array, whole
        assert got["ours"]["rows"][0] == [[0, 1], [0, 2], [1, 1], [1, 2]]   # rank order
        assert got["ours"]["vector"][0] == [0, 1, 10, 11]
        assert got["ours"]["scalar"][0] == [0.5, 1.5]             # 0-d: stacked
        for name, (value, dtype, kind) in got["ours"].items():
            assert kind == "ndarray"
            assert [value, dtype] == got["theirs"][name], name    # JAX's own values and dtype
        assert got["last"] == [0, 1]
        assert got["mismatch"] is not None and "different names" in got["mismatch"]
    # rank 0's last act to the launcher's end: no part of a gather was left for the
    # interpreter's exit to wait out (it took ~150 s when one was, under load)
    assert ended - float((tmp_path / "ended0").read_text()) < 20
