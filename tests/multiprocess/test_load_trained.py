"""`spmd.load` of a run trained on 2 ranks x 4 devices under fsdp, onto one CPU device in a
process of its own: the parameters are bit-identical to the run's final parameters (the
state the checkpointer restores on the run's own mesh), from either tier. And `spmd predict`
as a job of the same 2 ranks, to a Zarr store: rank 0 alone writes it, and it holds what the
model loaded onto one device predicts (the default `Task.predict`), in the input's order."""

from __future__ import annotations

import subprocess
import sys

import h5py
import numpy as np
import pytest

from tests.helpers.checkpoint_worker import _env, dump, train
from tests.helpers.env import REPO, run_spmd

pytestmark = pytest.mark.slow

LOAD = """
import sys, h5py, numpy as np, jax
import spmd
from spmd.checkpoint.layout import leaf_paths
assert len(jax.devices()) == 1
with h5py.File(sys.argv[2]) as f:
    inputs = f["test/inputs"][:]
for i, path in enumerate(sys.argv[3:]):
    trained = spmd.load(path)
    np.save(f"{sys.argv[1]}{i}.npy", trained.task.predict(trained.model, {"inputs": inputs}))
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
    data = tmp_path / "inputs.h5"                     # 21 examples: batches of 16, padded
    with h5py.File(data, "w") as f:
        f["test/inputs"] = np.random.default_rng(3).normal(size=(21, 32)).astype(np.float32)
    job = run_spmd("run", "-n", "2", "--entry", "predict", str(run_dir), "--", "--input",
                   str(data), "--output", str(tmp_path / "pred.zarr"), env=_env(4))
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-5000:]
    out = str(tmp_path / "loaded")
    r = subprocess.run([sys.executable, "-c", LOAD, out, str(data), str(run_dir / "checkpoints"),
                        str(run_dir / "local" / "4")], cwd=REPO, env=_env(1),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-5000:]
    import zarr

    predicted = zarr.open_group(str(tmp_path / "pred.zarr"), mode="r")["prediction"]
    assert predicted.shape == (21, 8) and predicted.attrs["rollout"] == 1
    np.testing.assert_allclose(predicted[...], np.load(f"{out}0.npy"), rtol=1e-5, atol=1e-6)
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary
    for i, tier in enumerate(("persistent", "local")):
        with np.load(f"{out}{i}.npz") as z:
            assert int(z["step"]) == 4 and tier in str(z["source"])
            got = {k: z[k] for k in z.files if k.startswith("params/")}
        assert sorted(got) == sorted(expected), tier
        differ = [k for k in expected if got[k].dtype != expected[k].dtype
                  or got[k].tobytes() != expected[k].tobytes()]
        assert differ == [], (tier, differ)
