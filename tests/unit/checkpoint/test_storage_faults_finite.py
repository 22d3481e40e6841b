"""Non-finite parameters in checkpoints (issue 23, fault 5b): retention never deletes the
newest step whose parameters are finite (both tiers record `params_finite` when a save starts),
and `spmd ckpt verify` names the step, parameter and count of NaN/Inf values, exiting 1."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from spmd.checkpoint.files import read_json
from spmd.checkpoint.listing import (
    nonfinite_persistent_steps,
    scan_local,
    scan_persistent,
    verify_local,
)
from spmd.checkpoint.persistent import MANIFEST, VerifiedLatestN
from spmd.config.load import config_from_dict
from tests.helpers.env import run_spmd
from tests.helpers.stand_ins import RecordedEvents, one_process_checkpointer


@pytest.fixture
def mesh():
    return jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "tensor"))


def _state(mesh, seed: int, nan: int = 0) -> dict:
    """A train-state-like dict; `nan` NaNs in params/w (sharded over the mesh)."""
    w = np.random.default_rng(seed).standard_normal((16, 8)).astype(np.float32)
    w.flat[:nan] = np.nan
    return {"step": jax.device_put(jnp.int32(seed), NamedSharding(mesh, P())),
            "params": {"w": jax.device_put(w, NamedSharding(mesh, P("data", "tensor"))),
                       "b": jax.device_put(jnp.ones(8, jnp.bfloat16), NamedSharding(mesh, P()))}}


def _cfg(run_dir: Path, **ck):
    return config_from_dict({"run": {"dir": str(run_dir)},
                             "checkpoint": {"every": 1, "persistent_every": 1, "keep": 1, **ck}})


def test_retention_keeps_the_newest_step_with_finite_parameters(tmp_path, mesh):
    events = RecordedEvents()
    ck = one_process_checkpointer(_cfg(tmp_path), events)
    ck.maybe_save(1, _state(mesh, 1))
    for step in (2, 3):              # the run diverged: NaN parameters, saved anyway
        ck.maybe_save(step, _state(mesh, step, nan=3))
    ck.wait()
    assert [s.step for s in scan_persistent(tmp_path / "checkpoints")] == [1, 3]
    # the local tier also keeps step 2 until a newer step is committed on every rank
    assert [s.step for s in scan_local(tmp_path / "local")] == [1, 2, 3]
    manifests = {s: read_json(tmp_path / "checkpoints" / str(s) / MANIFEST) for s in (1, 3)}
    assert [manifests[s]["params_finite"] for s in (1, 3)] == [True, False]
    marker = read_json(tmp_path / "local" / "3" / "rank00000" / "COMMITTED")
    assert marker["params_finite"] is False
    saved = {(e["tier"], e["step"]): e for e in events.of("saved")}
    assert saved[("persistent", 3)]["dropped"] == [2]          # never step 1
    assert [saved[("local", s)]["params_finite"] for s in (1, 2, 3)] == [True, False, False]
    ck.maybe_save(4, _state(mesh, 4))   # finite again: step 1 is no longer needed
    ck.close()
    assert [s.step for s in scan_persistent(tmp_path / "checkpoints")] == [4]
    assert [s.step for s in scan_local(tmp_path / "local")] == [3, 4]


def test_orbax_preservation_policy_keeps_the_newest_finite_step(tmp_path):
    for step, finite in ((1, True), (2, None), (3, False), (4, False)):
        (tmp_path / str(step)).mkdir()
        manifest = {"format": "spmd-persistent/1", "step": step, "files": {}}
        if finite is not None:
            manifest["params_finite"] = finite
        (tmp_path / str(step) / MANIFEST).write_text(json.dumps(manifest))
    infos = [SimpleNamespace(step=s) for s in (1, 2, 3, 4)]
    # step 2 has no field (written before it existed): it counts as finite
    assert VerifiedLatestN(1, tmp_path).should_preserve(infos, context=None) == [
        False, True, False, True]


def test_ckpt_verify_names_step_parameter_and_count_of_nonfinite_values(tmp_path, mesh):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = _cfg(run_dir, keep=5)
    (run_dir / "config.yaml").write_text(cfg.to_yaml())
    ck = one_process_checkpointer(cfg, RecordedEvents())
    ck.maybe_save(1, _state(mesh, 1))
    ck.maybe_save(2, _state(mesh, 2, nan=5))
    ck.close()
    # a step written before `params_finite` existed is read through Orbax and found finite
    manifest = run_dir / "checkpoints" / "1" / MANIFEST
    old = read_json(manifest)
    del old["params_finite"]
    manifest.write_text(json.dumps(old))
    found, unreadable = nonfinite_persistent_steps(run_dir / "checkpoints")
    assert unreadable == []
    assert [(r["step"], r["param"], r["nonfinite"], r["size"]) for r in found] == [
        (2, "w", 5, 128)]
    local: list[dict] = []
    assert verify_local(run_dir / "local", local)[0] == []
    assert [(r["step"], r["param"], r["nonfinite"], r["size"]) for r in local] == [
        (2, "w", 5, 128)]

    r = run_spmd("ckpt", "verify", str(run_dir))
    assert r.returncode == 1, r.stdout + r.stderr
    lines = [x for x in r.stderr.splitlines() if x.startswith("NON-FINITE: ")]
    assert lines == [
        f"NON-FINITE: local step 2 ({run_dir / 'local' / '2'}): parameter w holds 5 "
        "non-finite value(s) (NaN/Inf) of 128",
        f"NON-FINITE: persistent step 2 ({run_dir / 'checkpoints' / '2'}): parameter w holds 5 "
        "non-finite value(s) (NaN/Inf) of 128"], r.stderr
    assert "Traceback" not in r.stderr and "DAMAGED" not in r.stderr
    as_json = json.loads(run_spmd("ckpt", "verify", str(run_dir), "--json").stdout)
    assert not as_json["ok"] and len(as_json["nonfinite"]) == 2
