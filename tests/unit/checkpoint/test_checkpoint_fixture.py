"""A checkpoint written by an earlier spmd (tests/fixtures/) restores bit-identically.

The on-disk format is a contract: a run saved before a release must resume after it. The
fixture was written at commit 5924438 on one CPU device; it is restored here from its local
tier on one device, and from its persistent tier onto 8 devices (a reshard), through the
trainer itself, and every leaf of the state must equal what the writing process held.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from spmd.engine.state import train_rng
from tests.helpers.env import REPO, clean_env
from tests.helpers.records import read_jsonl

FIXTURE = REPO / "tests" / "fixtures" / "checkpoint_5924438"

RESTORE = """
import sys
import jax, numpy as np
import spmd

run_dir, out = sys.argv[1], sys.argv[2]


class Capture:
    def start(self, info):
        state = jax.device_get(info.state)
        leaves = jax.tree_util.tree_flatten_with_path(state)[0]
        np.savez(out, **{jax.tree_util.keystr(p): np.asarray(x) for p, x in leaves})

    def __call__(self, info):
        pass


# one step past the fixture's last (train.steps 4): a run that already finished stops
# without compiling, before any hook starts
code = spmd.train(f"{run_dir}/config.yaml", overrides=[f"run.dir={run_dir}", "train.steps=5"],
                  hooks=[(Capture(), 1)])
sys.exit(code)
"""


def restore(tmp_path: Path, *, keep_local: bool, devices: int) -> tuple[dict, dict]:
    run_dir = tmp_path / "run"
    shutil.copytree(FIXTURE, run_dir)
    (run_dir / "expected_state.npz").unlink()
    if not keep_local:
        shutil.rmtree(run_dir / "local")
    out = tmp_path / "restored.npz"
    r = subprocess.run([sys.executable, "-c", RESTORE, str(run_dir), str(out)], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300,
                       env=clean_env(JAX_NUM_CPU_DEVICES=str(devices)))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    restored = next(e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "restored")
    with np.load(out) as data:
        return {k: data[k] for k in data.files}, restored


@pytest.mark.parametrize(("keep_local", "devices", "source"),
                         [(True, 1, "local"), (False, 8, "persistent")])
def test_a_checkpoint_from_before_the_layers_move_restores_bit_identically(
        tmp_path, keep_local, devices, source):
    state, restored = restore(tmp_path, keep_local=keep_local, devices=devices)
    assert restored["step"] == 4 and restored["source"] == source, restored
    with np.load(FIXTURE / "expected_state.npz") as data:
        expected = {k: data[k] for k in data.files}
    # Written before the train state had an RNG key: restored without one, the key is set
    # from train.seed as a fresh run's would be, and the log says so (issue 20).
    assert sorted(state) == sorted([*expected, ".rng"])
    assert np.array_equal(state[".rng"], np.asarray(train_rng(0)))
    assert "holds no RNG key" in (tmp_path / "run" / "logs" / "rank00000.log").read_text()
    for path, want in expected.items():
        got = state[path]
        assert got.dtype == want.dtype and got.shape == want.shape, path
        assert np.array_equal(got, want), f"{path} differs from what was saved"
