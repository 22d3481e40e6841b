"""`Task.eval_batch_fields()`: evaluation batches with their own layout (e.g. a rollout
target of many steps) get their own feed and compiled eval/sample steps; training keeps
`batch_fields()`. A task that returns None evaluates on the training layout as before."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from spmd.config.load import config_from_dict
from spmd.data.batch import BatchField
from spmd.engine.mesh import build_mesh
from spmd.loop.builtin_hooks import evaluate
from spmd.tasks.regression import RegressionTask
from tests.helpers.training import mlp_config, runtime_for, train_steps

HORIZON = 3


class HorizonSource:
    """Eval batches whose target holds HORIZON copies of d_out values: row r of step s is
    the constant s + r / 100, so the metric below is known exactly."""

    def __init__(self, d_in: int, d_out: int):
        self.d_in, self.d_out = d_in, d_out

    def rows(self, step: int, start: int, stop: int) -> dict[str, np.ndarray]:
        values = step + np.arange(start, stop, dtype=np.float32) / 100
        return {"inputs": np.repeat(values[:, None], self.d_in, axis=1),
                "targets": np.repeat(values[:, None, None], HORIZON, axis=1)
                .repeat(self.d_out, axis=2)}


class HorizonTask(RegressionTask):
    def eval_batch_fields(self):
        m = self.model_cfg
        return {"inputs": BatchField((m.d_in,), np.float32, ("batch", "embed")),
                "targets": BatchField((HORIZON, m.d_out), np.float32,
                                      ("batch", None, "channels"))}

    def eval_source(self):
        m = self.model_cfg
        return HorizonSource(m.d_in, m.d_out)

    def eval_metrics(self, model, batch):
        pred = model(batch["inputs"])
        return {"horizon": jnp.asarray(batch["targets"].shape[1], jnp.float32),
                "target_mean": jnp.mean(batch["targets"]),
                "finite": jnp.all(jnp.isfinite(pred)).astype(jnp.float32)}

    def sample_outputs(self, model, batch):
        return {"targets": batch["targets"]}


@pytest.mark.usefixtures("keep_signal_handlers")
def test_eval_batches_take_the_tasks_eval_layout_and_training_its_own(tmp_path):
    raw = mlp_config(tmp_path / "run", steps=2, train={"eval_every": 1},
                     data={"eval_batches": 2})
    cfg = config_from_dict(raw, "test")
    task = HorizonTask(cfg)
    rt = runtime_for(cfg, build_mesh(cfg.mesh), task)
    assert rt.eval_feed is not rt.feed
    assert rt.feed.fields["targets"].example_shape == (cfg.model.d_out,)
    assert rt.eval_feed.fields["targets"].example_shape == (HORIZON, cfg.model.d_out)

    losses, state = train_steps(rt, 2)              # the train layout still trains
    assert all(np.isfinite(losses))
    sample = tmp_path / "sample.npz"
    metrics = evaluate(rt, state.params, sample)
    assert metrics["horizon"] == HORIZON
    batch = cfg.train.batch_size                   # mean over steps 0, 1 of s + r / 100
    want = np.mean([s + np.arange(batch) / 100 for s in range(2)])
    assert metrics["target_mean"] == pytest.approx(want, rel=1e-6)
    assert metrics["finite"] == 1.0
    assert np.load(sample)["targets"].shape[1:] == (HORIZON, cfg.model.d_out)


@pytest.mark.usefixtures("keep_signal_handlers")
def test_a_task_without_an_eval_layout_shares_the_training_feed(tmp_path):
    cfg = config_from_dict(mlp_config(tmp_path / "run", train={"eval_every": 1}), "test")
    rt = runtime_for(cfg, build_mesh(cfg.mesh), RegressionTask(cfg))
    assert rt.eval_feed is rt.feed
    assert rt.eval_step is not None and rt.sample_step is None
