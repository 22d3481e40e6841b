"""`spmd.load` of a run trained on 2 ranks x 4 devices under fsdp, onto one CPU device in a
process of its own: the parameters are bit-identical to the run's final parameters (the
state the checkpointer restores on the run's own mesh), from either tier."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from tests.helpers.checkpoint_worker import _env, dump, train
from tests.helpers.env import REPO

pytestmark = pytest.mark.slow

LOAD = """
import sys, numpy as np, jax
import spmd
from spmd.checkpoint.layout import leaf_paths
assert len(jax.devices()) == 1
for i, path in enumerate(sys.argv[2:]):
    trained = spmd.load(path)
    assert {len(x.sharding.device_set) for x in jax.tree.leaves(trained.params)} == {1}
    arrays = dict(zip(leaf_paths({"params": trained.params}),
                      map(np.asarray, jax.tree.leaves(trained.params))))
    np.savez(f"{sys.argv[1]}{i}.npz", step=trained.step, source=trained.source, **arrays)
"""


def test_a_two_rank_fsdp_run_loads_onto_one_device_bit_identically(tmp_path):
    run_dir = tmp_path / "run"
    ck = ("train.steps=4", "checkpoint.every=4", "checkpoint.timeout_s=60",
          "mesh.strategy=fsdp")
    proc = train(2, run_dir, *ck, devices=4)   # local step 4, and the final persistent save
    assert proc.returncode == 0, proc.stderr[-6000:]
    final = dump(2, run_dir, tmp_path / "final.npz", *ck)
    assert final["sources"] == ["local", "local"] and final["step"] == 4
    expected = {k: v for k, v in final["arrays"].items() if k.startswith("params/")}
    assert len(expected) > 3
    out = str(tmp_path / "loaded")
    r = subprocess.run([sys.executable, "-c", LOAD, out, str(run_dir / "checkpoints"),
                        str(run_dir / "local" / "4")], cwd=REPO, env=_env(1),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-5000:]
    for i, tier in enumerate(("persistent", "local")):
        with np.load(f"{out}{i}.npz") as z:
            assert int(z["step"]) == 4 and tier in str(z["source"])
            got = {k: z[k] for k in z.files if k.startswith("params/")}
        assert sorted(got) == sorted(expected), tier
        differ = [k for k in expected if got[k].dtype != expected[k].dtype
                  or got[k].tobytes() != expected[k].tobytes()]
        assert differ == [], (tier, differ)
