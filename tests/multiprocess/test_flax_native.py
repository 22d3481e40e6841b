"""A model written for Flax (tests/helpers/flax_native.py: every parameter annotated only
with `nnx.with_partitioning`, Flax-style task rules on its own 'model' mesh axis, mapped with
`mesh.axis_aliases.model=tensor`) trains on 2 ranks x 4 CPU devices under dp, fsdp, tp and
fsdp_tp with the losses of one process on one device (computed once in this process), and
resumes bit-identically.

Kept cheap: one 2-rank run per strategy (4 steps), and one more that resumes the fsdp_tp run
from its step-2 checkpoint.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

from spmd.config.load import load_config
from spmd.engine.mesh import build_mesh
from tests.helpers.env import clean_env, mpiexec_path, run_spmd
from tests.helpers.training import runtime_for, train_steps

pytestmark = pytest.mark.slow

STEPS = 4
CONFIG = {"task": "tests.helpers.flax_native:FlaxLMTask",
          "train": {"steps": STEPS, "batch_size": 8}, "optimizer": {"lr": 0.01},
          "run": {"progress": False, "plots": False},
          "mesh": {"axis_aliases": {"model": "tensor"}}}


def metrics(run_dir: Path) -> dict[int, float]:
    """step -> loss; a resumed run's records of a step replace the earlier ones."""
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in lines if "loss" in r}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("flax_native")
    (root / "lm.json").write_text(json.dumps(CONFIG))
    return root


@pytest.fixture(scope="module")
def reference(workdir) -> list[float]:
    """1 process on 1 device: the losses every 2-rank run must match."""
    cfg = load_config(workdir / "lm.json", ["mesh.strategy=dp"])
    return train_steps(runtime_for(cfg, build_mesh(cfg.mesh, jax.devices()[:1])), STEPS)[0]


_RUNS: dict[str, Path] = {}


def two_ranks(workdir: Path, strategy: str) -> Path:
    """The strategy's 2-rank run (once per module); fsdp_tp keeps its step-2 checkpoint."""
    if strategy not in _RUNS:
        mpiexec_path()
        run_dir = workdir / strategy
        saves = (["checkpoint.persistent_every=2"] if strategy == "fsdp_tp"
                 else ["checkpoint.final=false"])
        r = run_spmd("run", "-n", "2", str(workdir / "lm.json"), f"run.dir={run_dir}",
                     f"mesh.strategy={strategy}", *saves,
                     env=clean_env(JAX_NUM_CPU_DEVICES="4"), timeout=300)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
        _RUNS[strategy] = run_dir
    return _RUNS[strategy]


@pytest.mark.parametrize("strategy", ["dp", "fsdp", "tp", "fsdp_tp"])
def test_two_ranks_match_one_process(workdir, reference, strategy):
    run_dir = two_ranks(workdir, strategy)
    got = metrics(run_dir)
    assert sorted(got) == list(range(1, STEPS + 1))
    np.testing.assert_allclose([got[s] for s in sorted(got)], reference, rtol=1e-5)
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    assert {e["size"] for e in events if e["event"] == "started"} == {2}


def test_resume_from_a_checkpoint_is_bit_identical(workdir):
    full = two_ranks(workdir, "fsdp_tp")
    resumed = workdir / "fsdp_tp_resumed"
    shutil.copytree(full, resumed)
    shutil.rmtree(resumed / "checkpoints" / str(STEPS))   # the newest left is step 2
    r = run_spmd("run", "-n", "2", str(workdir / "lm.json"), f"run.dir={resumed}",
                 "mesh.strategy=fsdp_tp", "checkpoint.persistent_every=2",
                 env=clean_env(JAX_NUM_CPU_DEVICES="4"), timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    events = [json.loads(x) for x in (resumed / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "restored"][-1:] == [2]
    want, got = metrics(full), metrics(resumed)
    assert [got[s] for s in (3, 4)] == [want[s] for s in (3, 4)]   # bit for bit
