"""Randomness and modes in the task (issue 20 part 4), in this process on 8 CPU devices.

The train state holds a key; update k draws from fold_in(key, k). `Task.loss` and
`Task.eval_metrics` get `rngs`/`train` only when their signature asks. Training runs the
model in train mode, evaluation in eval mode (deterministic). A Dropout that holds its own
RNG stream is reseeded per step. A checkpoint written before the state had a key restores.
"""

from __future__ import annotations

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from spmd.api import train
from spmd.checkpoint.local import MARKER
from spmd.config.load import config_from_dict
from spmd.engine.mesh import build_mesh
from spmd.engine.state import step_key, train_rng
from spmd.engine.step import task_options, with_options
from spmd.errors import SpmdError
from spmd.tasks.regression import RegressionTask
from tests.helpers.dropout_task import DropoutTask, HeldRngsTask
from tests.helpers.records import read_jsonl
from tests.helpers.stand_ins import RecordedEvents, one_process_checkpointer
from tests.helpers.training import mlp_config, runtime_for, train_steps

pytestmark = pytest.mark.usefixtures("keep_signal_handlers")


# ------------------------------------------------------------------ signature detection

class Signatures:
    def two(self, model, batch): ...
    def rngs_only(self, model, batch, *, rngs=None): ...
    def train_only(self, model, batch, train=True): ...
    def both(self, model, batch, *, rngs=None, train=True): ...
    def kwargs(self, model, batch, **options): ...
    def positional_only(self, model, batch, rngs=None, /): ...


@pytest.mark.parametrize(("name", "accepted"), [
    ("two", set()), ("rngs_only", {"rngs"}), ("train_only", {"train"}),
    ("both", {"rngs", "train"}), ("kwargs", {"rngs", "train"}), ("positional_only", set()),
])
def test_only_the_keywords_a_task_method_accepts_are_detected(name, accepted):
    assert task_options(getattr(Signatures(), name)) == accepted


def test_a_task_method_gets_exactly_what_its_signature_names():
    seen = []

    def two(model, batch):
        seen.append({})

    def train_only(model, batch, *, train):
        seen.append({"train": train})

    def everything(model, batch, **options):
        seen.append(options)

    key = jax.random.key(0)
    for fn in (two, train_only, everything):
        with_options(fn)("model", "batch", key=key, train=False)
    assert seen[0] == {} and seen[1] == {"train": False}
    assert sorted(seen[2]) == ["rngs", "train"] and seen[2]["train"] is False
    rngs = seen[2]["rngs"]
    assert isinstance(rngs, nnx.Rngs) and "dropout" in rngs and "default" in rngs
    assert task_options(RegressionTask.loss) == set()   # built-ins keep the 2-argument form


def test_step_keys_are_a_pure_function_of_seed_and_step():
    def data(seed, step):
        return np.asarray(jax.random.key_data(step_key(train_rng(seed), step)))

    assert np.array_equal(data(0, 3), data(0, 3))
    assert np.array_equal(data(0, 3), jax.jit(lambda r: jax.random.key_data(
        step_key(r, jnp.int32(3))))(train_rng(0)))
    assert not np.array_equal(data(0, 3), data(0, 4))
    assert not np.array_equal(data(0, 3), data(1, 3))
    assert train_rng(0).dtype == jnp.uint32   # an ordinary array, for Orbax and partners


# ------------------------------------------------------------------ modes and dropout

def runtime(task: str, rate: float):
    cfg = config_from_dict({
        "task": f"tests.helpers.dropout_task:{task}",
        "run": {"dir": "unused", "plots": False, "progress": False},
        "model": {"dropout": rate},
        "train": {"steps": 4, "batch_size": 8, "eval_every": 1, "donate": False}})
    return runtime_for(cfg, build_mesh(cfg.mesh, jax.devices()))


@pytest.mark.parametrize("task", ["DropoutTask", "HeldRngsTask"])
def test_dropout_is_active_in_training_and_evaluation_is_deterministic(task):
    rt, plain = runtime(task, 0.1), runtime(task, 0.0)
    state = rt.init()
    batch = rt.feed.global_batch(rt.task.train_source(), 0)
    loss = lambda s: float(rt.train_step(s, batch)[1]["loss"])  # noqa: E731

    assert loss(state) == loss(state)                       # a pure function of the state
    assert loss(state) != loss(state.replace(step=state.step + 1))   # another step's masks
    assert loss(state) != float(plain.train_step(plain.init(), batch)[1]["loss"])
    evaluated = [float(rt.eval_step(state.params, batch)["eval_loss"]) for _ in range(2)]
    assert evaluated[0] == evaluated[1] != loss(state)       # eval mode: no dropout
    no_dropout = float(plain.eval_step(state.params, batch)["eval_loss"])
    np.testing.assert_allclose(evaluated[0], no_dropout, rtol=1e-6)
    if task == "DropoutTask":   # the task saw the mode it runs in
        assert float(rt.train_step(state, batch)[1]["train_mode"]) == 1.0
        assert float(rt.eval_step(state.params, batch)["eval_train_flag"]) == 0.0
    losses, final = train_steps(rt, 3)
    assert all(np.isfinite(losses)) and int(final.step) == 3


def test_a_dropout_holding_rngs_is_reseeded_per_key_and_path():
    layout = runtime("HeldRngsTask", 0.1).model
    params = nnx.to_pure_dict(nnx.state(HeldRngsTask.build_model(
        HeldRngsTask(runtime("HeldRngsTask", 0.1).task.cfg), nnx.Rngs(0)), nnx.Param))

    def stream(key):
        model = layout.merge(params, key, train=True)
        assert model.drop.deterministic is False
        return np.asarray(jax.random.key_data(model.drop.rngs.key.get_value()))

    k0, k1 = jax.random.key(0), jax.random.key(1)
    assert np.array_equal(stream(k0), stream(k0)) and not np.array_equal(stream(k0), stream(k1))
    assert layout.merge(params).drop.deterministic is True   # eval mode by default


def test_a_model_with_batch_statistics_is_refused_naming_the_variable():
    class Normed(nnx.Module):
        def __init__(self, rngs):
            self.dense = nnx.Linear(4, 4, rngs=rngs)
            self.norm = nnx.BatchNorm(4, rngs=rngs)

    class NormTask(DropoutTask):
        def build_model(self, rngs):
            return Normed(rngs)

    cfg = config_from_dict({"task": "tests.helpers.dropout_task:DropoutTask",
                            "run": {"dir": "unused"}, "train": {"batch_size": 8}})
    with pytest.raises(SpmdError) as e:
        runtime_for(cfg, build_mesh(cfg.mesh, jax.devices()), NormTask(cfg))
    assert "norm/mean (BatchStat)" in str(e.value) and "RNG streams" in str(e.value)


# ------------------------------------------------------------------ old checkpoints

@pytest.mark.parametrize("tier", ["local", "persistent"])
def test_a_checkpoint_without_an_rng_key_restores_and_resumes_identically(tmp_path, tier):
    """A step saved as spmd saved it before the key existed (no `rng` leaf in either tier)
    restores; the key comes from train.seed, so the run goes on as an uninterrupted one."""
    ck = {"every": 2, "persistent_every": 2}
    whole = tmp_path / "whole"
    assert train(mlp_config(whole, steps=3, checkpoint=ck)) == 0
    expected = {r["step"]: r["loss"] for r in read_jsonl(whole / "metrics.jsonl")}

    run_dir = tmp_path / "old"
    cfg = config_from_dict(mlp_config(run_dir, steps=3, checkpoint=ck))
    rt = runtime_for(cfg, build_mesh(cfg.mesh, jax.devices()))
    _, state = train_steps(rt, 2)
    checkpointer = one_process_checkpointer(cfg, RecordedEvents())
    checkpointer.maybe_save(2, state.replace(rng=None), force=True)   # the old layout
    checkpointer.close()
    assert (run_dir / "local" / "2" / "rank00000" / MARKER).is_file()
    if tier == "persistent":
        shutil.rmtree(run_dir / "local")
    assert train(mlp_config(run_dir, steps=3, checkpoint=ck)) == 0
    restored = next(e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "restored")
    assert restored["step"] == 2 and restored["source"] == tier, restored
    assert "holds no RNG key" in (run_dir / "logs" / "rank00000.log").read_text()
    got = {r["step"]: r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl")}
    assert got[3] == expected[3]
