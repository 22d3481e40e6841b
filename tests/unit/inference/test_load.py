"""`spmd.load`: a finished run's parameters back, bit for bit, from either tier (by default
the newest step of both, a local step newer than every persistent one included) and from
checkpoints written before the persistent tier split its items; the `params` item alone
suffices (no optimizer state is read), for spmd.load and for the documented plain-Orbax
snippet onto a sharding over 8 devices; `checkpoint.final` makes a run with no checkpoint
schedule loadable; bad paths, steps and bytes are named."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

import spmd
from spmd.checkpoint import CheckpointError
from spmd.checkpoint.persistent import MANIFEST
from spmd.errors import SpmdError
from spmd.inference import run_mesh
from spmd.loop.hooks import StepInfo
from tests.helpers.env import REPO
from tests.helpers.records import read_jsonl
from tests.helpers.training import mlp_config

FIXTURE = REPO / "tests" / "fixtures" / "checkpoint_5924438"


pytestmark = pytest.mark.usefixtures("keep_signal_handlers")


def fsdp_config(run_dir: Path, **checkpoint) -> dict:
    return mlp_config(run_dir, steps=4, mesh={"strategy": "fsdp"}, checkpoint=checkpoint)


def train_and_keep_final_params(config: dict) -> dict:
    """Train in this process (8 CPU devices); the final parameters, gathered to host."""
    final: dict = {}

    def keep(info: StepInfo) -> None:
        if info.final:
            final.update(params=jax.tree.map(np.asarray, jax.device_get(info.state.params)))

    assert spmd.train(config, hooks=[(keep, 1)]) == 0
    return final["params"]


def leaves(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def same_bytes(a, b) -> bool:
    la, lb = leaves(a), leaves(b)
    return len(la) == len(lb) and all(x.dtype == y.dtype and x.shape == y.shape
                                      and x.tobytes() == y.tobytes() for x, y in zip(la, lb))


def test_a_run_without_a_checkpoint_schedule_is_loadable_bit_identically(run_dir):
    final = train_and_keep_final_params(fsdp_config(run_dir))   # checkpoint: {} (defaults)
    saved = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "saved"]
    assert [(e["tier"], e["step"]) for e in saved] == [("persistent", 4)]
    assert sorted(p.name for p in (run_dir / "checkpoints" / "4").iterdir()
                  if p.is_dir()) == ["params", "train_state"]
    trained = spmd.load(run_dir)
    assert trained.step == 4 and "persistent" in trained.source
    assert same_bytes(trained.params, final)
    assert {len(x.sharding.device_set) for x in jax.tree.leaves(trained.params)} == {1}
    assert type(trained.model).__name__ == "Mlp"
    assert type(trained.task).__name__ == "RegressionTask" and trained.config.train.steps == 4


def test_checkpoint_final_false_leaves_nothing_and_load_says_so(run_dir):
    train_and_keep_final_params(fsdp_config(run_dir, final=False))
    assert not (run_dir / "checkpoints").exists()
    with pytest.raises(CheckpointError, match="no committed checkpoint.*checkpoint.final"):
        spmd.load(run_dir)


def test_both_tiers_and_each_step_load_the_same_bytes(run_dir):
    final = train_and_keep_final_params(fsdp_config(run_dir, every=2, keep=2))
    newest = spmd.load(run_dir)                       # step 4 is in both tiers
    local = spmd.load(run_dir / "local" / "4")        # the node-local blob, assembled
    persistent = spmd.load(run_dir / "checkpoints")   # a tier directory: its newest step
    assert (newest.step, local.step, persistent.step) == (4, 4, 4)
    assert "local" in local.source and "persistent" in persistent.source
    assert same_bytes(local.params, final) and same_bytes(persistent.params, final)
    older = spmd.load(run_dir, step=2)
    assert older.step == 2 and "local" in older.source
    assert not same_bytes(older.params, final)
    with pytest.raises(CheckpointError, match=r"no committed checkpoint of step 3.*\[2, 4\]"):
        spmd.load(run_dir, step=3)


def test_by_default_a_local_step_newer_than_every_persistent_step_is_loaded(run_dir):
    final = train_and_keep_final_params(mlp_config(
        run_dir, steps=3, mesh={"strategy": "fsdp"},
        checkpoint={"every": 1, "persistent_every": 2}))   # local 2, 3; persistent 2, 3
    # the persistent save of step 3 never committed (the job died while Orbax wrote it):
    (run_dir / "checkpoints" / "3" / MANIFEST).unlink()
    assert (run_dir / "local" / "3").is_dir() and (run_dir / "checkpoints" / "2").is_dir()
    newest = spmd.load(run_dir)                       # no step=: local 3 beats persistent 2
    assert newest.step == 3 and "local" in newest.source
    assert same_bytes(newest.params, final)
    older = spmd.load(run_dir, step=2)                # in both tiers: the persistent one
    assert older.step == 2 and "persistent" in older.source
    assert not same_bytes(older.params, final)


def orbax_snippet() -> str:
    """The plain-Orbax snippet of docs/using_a_trained_run.md, extracted as test_main_job
    does."""
    text = (REPO / "docs" / "using_a_trained_run.md").read_text()
    block = text.split("## Reading a persistent checkpoint with plain Orbax", 1)[1]
    return re.search(r"```python\n(.+?)\n```", block, re.S).group(1)


ONE_DEVICE = "device = jax.sharding.SingleDeviceSharding(jax.devices()[0])"


def test_the_params_item_alone_loads_without_optimizer_state_also_with_plain_orbax(run_dir):
    """No optimizer state is read: with the step's `train_state` item deleted, spmd.load
    and the docs' plain-Orbax snippet, given a NamedSharding over the 8 devices as the docs
    say it may be, read the same bytes as the run's final parameters."""
    final = train_and_keep_final_params(fsdp_config(run_dir))
    step_dir = run_dir / "checkpoints" / "4"
    shutil.rmtree(step_dir / "train_state")           # the optimizer state (and the rest)
    trained = spmd.load(run_dir)
    assert trained.step == 4 and "persistent" in trained.source
    assert same_bytes(trained.params, final)

    snippet = orbax_snippet()
    assert ONE_DEVICE in snippet and 'step_dir = "runs/fno_darcy/checkpoints/200"' in snippet
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
    assert mesh.size == 8
    snippet = snippet.replace(ONE_DEVICE, "device = jax.sharding.NamedSharding(mesh, "
                                          "jax.sharding.PartitionSpec('x'))")
    snippet = snippet.replace("runs/fno_darcy/checkpoints/200", str(step_dir))
    scope: dict = {"mesh": mesh}
    exec(compile(snippet, "docs/using_a_trained_run.md (plain Orbax)", "exec"), scope)
    params = scope["params"]   # Orbax's pure dict: keys as strings ('0' for nnx.List's 0)
    assert [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)] \
        == [jax.tree_util.keystr(p).replace("[0]", "['0']")
            for p, _ in jax.tree_util.tree_leaves_with_path(trained.params)]
    assert {len(x.sharding.device_set) for x in jax.tree.leaves(params)} == {8}
    assert all(not x.sharding.is_fully_replicated for x in jax.tree.leaves(params))
    assert same_bytes(params, final)


def test_onto_a_mesh_the_parameters_are_sharded_by_the_runs_rules(run_dir):
    final = train_and_keep_final_params(fsdp_config(run_dir))
    mesh = run_mesh(spmd.load_config(run_dir / "config.yaml"))
    trained = spmd.load(run_dir, mesh=mesh)
    assert mesh.shape["fsdp"] == 8
    assert max(len(x.sharding.device_set) for x in jax.tree.leaves(trained.params)) == 8
    assert any(not x.sharding.is_fully_replicated for x in jax.tree.leaves(trained.params))
    assert same_bytes(trained.params, final)


def test_a_checkpoint_written_before_the_split_items_still_loads(tmp_path):
    run_dir = tmp_path / "old"
    shutil.copytree(FIXTURE, run_dir)
    shutil.rmtree(run_dir / "local")                  # the persistent `default` item alone
    trained = spmd.load(run_dir)
    assert trained.step == 4 and (run_dir / "checkpoints" / "4" / "default").is_dir()
    with np.load(FIXTURE / "expected_state.npz") as z:
        expected = {k: z[k] for k in z.files if k.startswith(".params")}
    got = {f".params{jax.tree_util.keystr(path)}": np.asarray(x)
           for path, x in jax.tree_util.tree_flatten_with_path(trained.params)[0]}
    assert sorted(got) == sorted(expected)
    assert all(got[k].tobytes() == expected[k].tobytes() for k in expected)


def test_a_flipped_byte_in_the_parameters_is_named(run_dir):
    train_and_keep_final_params(fsdp_config(run_dir))
    victim = max((run_dir / "checkpoints" / "4" / "params").rglob("d/*"),
                 key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 1
    victim.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=str(victim)):
        spmd.load(run_dir)


def test_a_path_without_a_run_is_refused_naming_it(tmp_path):
    with pytest.raises(SpmdError, match="does not exist"):
        spmd.load(tmp_path / "nowhere")
    with pytest.raises(SpmdError, match="no config.yaml"):
        spmd.load(tmp_path)
