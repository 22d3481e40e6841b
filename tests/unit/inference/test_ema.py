"""The EMA of the parameters (issue 21 item 5), in this process on 8 CPU devices.

`train.ema_decay` d keeps `TrainState.ema`: it starts at the initial parameters and follows
ema = d ema + (1 - d) params after every update, sharded like the parameters. It is
checkpointed (both tiers) and a resumed run's EMA is bit-identical to an uninterrupted one's;
a checkpoint without one (EMA just switched on) restores, the EMA starting from its
parameters. `train.eval_ema` evaluates with it, and `spmd.load(path, ema=True)` / `spmd eval`
read it. (Restoring onto another mesh and process count: tests/multiprocess/
test_recipe_parallel.py.)
"""

from __future__ import annotations

import shutil

import jax
import numpy as np
import pytest

import spmd
from spmd.checkpoint import CheckpointError
from spmd.config.load import config_from_dict
from spmd.engine.mesh import build_mesh
from spmd.errors import ConfigError
from spmd.inference.evaluation import evaluate_split
from tests.helpers.records import read_jsonl
from tests.helpers.training import mlp_config, runtime_for

pytestmark = pytest.mark.usefixtures("keep_signal_handlers")

DECAY = 0.9
CKPT = {"every": 2, "persistent_every": 2}


def host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


def test_ema_follows_the_parameters_and_is_sharded_like_them(tmp_path):
    cfg = config_from_dict(mlp_config(tmp_path, mesh={"strategy": "fsdp"},
                                      train={"ema_decay": DECAY}))
    rt = runtime_for(cfg, build_mesh(cfg.mesh, jax.devices()))
    state = rt.init()
    for e, p in zip(jax.tree.leaves(state.ema), jax.tree.leaves(state.params)):
        assert e.sharding == p.sharding and e.dtype == np.float32
        np.testing.assert_array_equal(np.asarray(e), np.asarray(p))   # starts at the params
    assert any(len(e.sharding.device_set) == 8 and e.sharding.spec != ()
               for e in jax.tree.leaves(state.ema))                  # really split by fsdp
    expected, source = host(state.params), rt.task.train_source()
    for step in range(3):
        state, _ = rt.train_step(state, rt.feed.global_batch(source, step))
        params = host(state.params)
        expected = jax.tree.map(lambda e, p: DECAY * e + (1 - DECAY) * p, expected, params)
    jax.tree.map(lambda e, want: np.testing.assert_allclose(e, want, rtol=1e-6, atol=1e-7),
                 host(state.ema), expected)
    assert not all(np.array_equal(e, p) for e, p in
                   zip(jax.tree.leaves(host(state.ema)), jax.tree.leaves(params)))


def test_ema_is_checkpointed_and_a_resumed_run_has_the_same_ema_bit_for_bit(tmp_path):
    train = {"ema_decay": DECAY}
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    assert spmd.train(mlp_config(whole, steps=4, train=train, checkpoint=CKPT)) == 0
    assert spmd.train(mlp_config(resumed, steps=2, train=train, checkpoint=CKPT)) == 0
    assert spmd.train(mlp_config(resumed, steps=4, train=train, checkpoint=CKPT)) == 0
    assert [e["step"] for e in read_jsonl(resumed / "events.jsonl")
            if e["event"] == "restored"] == [2]
    want = host(spmd.load(whole, ema=True).params)
    for where in (resumed, resumed / "local"):            # persistent tier, then local tier
        got = spmd.load(where, ema=True)
        assert got.ema and got.step == 4
        jax.tree.map(np.testing.assert_array_equal, host(got.params), want)
    params = host(spmd.load(resumed, ema=False).params)
    assert not all(np.array_equal(a, b) for a, b in
                   zip(jax.tree.leaves(params), jax.tree.leaves(want)))


@pytest.mark.parametrize("tier", ["local", "persistent"])
def test_a_checkpoint_without_an_ema_restores_with_the_ema_from_its_params(tmp_path, tier):
    run_dir = tmp_path / "run"
    assert spmd.train(mlp_config(run_dir, steps=2, checkpoint=CKPT)) == 0     # no EMA
    if tier == "persistent":
        shutil.rmtree(run_dir / "local")
    at_2 = host(spmd.load(run_dir).params)
    config = mlp_config(run_dir, steps=3, train={"ema_decay": DECAY}, checkpoint=CKPT)
    assert spmd.train(config) == 0
    restored = next(e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "restored")
    assert restored["step"] == 2 and restored["source"] == tier, restored
    log = (run_dir / "logs" / "rank00000.log").read_text()
    assert "holds no EMA of the parameters" in log and "starts from its parameters" in log
    at_3 = host(spmd.load(run_dir, ema=False).params)
    ema = host(spmd.load(run_dir, ema=True).params)
    jax.tree.map(lambda e, a, b: np.testing.assert_allclose(e, DECAY * a + (1 - DECAY) * b,
                                                            rtol=1e-6, atol=1e-7),
                 ema, at_2, at_3)


def test_eval_ema_evaluates_the_ema_and_spmd_eval_reproduces_it(tmp_path):
    run_dir = tmp_path / "run"
    config = mlp_config(run_dir, steps=4, checkpoint=CKPT,
                        train={"ema_decay": DECAY, "eval_ema": True, "eval_every": 4})
    assert spmd.train(config) == 0
    logged = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "eval_loss" in r]
    assert logged[-1]["step"] == 4
    with_ema = spmd.load(run_dir)                  # train.eval_ema: the EMA by default
    assert with_ema.ema
    assert evaluate_split(with_ema)["eval_loss"] == pytest.approx(logged[-1]["eval_loss"],
                                                                  rel=1e-6)
    plain = evaluate_split(spmd.load(run_dir, ema=False))["eval_loss"]
    assert plain != pytest.approx(logged[-1]["eval_loss"], rel=1e-6)


def test_eval_ema_without_an_ema_and_load_ema_of_a_run_without_one_are_errors(tmp_path):
    cfg = config_from_dict(mlp_config(tmp_path, train={"eval_ema": True}))
    with pytest.raises(ConfigError, match="train.eval_ema=true .* train.ema_decay"):
        runtime_for(cfg, build_mesh(cfg.mesh, jax.devices()))
    run_dir = tmp_path / "run"
    assert spmd.train(mlp_config(run_dir, steps=2, checkpoint=CKPT)) == 0
    for where in (run_dir, run_dir / "local"):
        with pytest.raises(CheckpointError, match="holds no EMA"):
            spmd.load(where, ema=True)


def test_switching_the_ema_off_restores_the_rest_of_the_state(tmp_path):
    """A step saved with an EMA restores into a run without one (the EMA is not read; the
    node-local copy, laid out with it, is passed over for the persistent tier)."""
    run_dir = tmp_path / "run"
    assert spmd.train(mlp_config(run_dir, steps=2, train={"ema_decay": DECAY},
                                 checkpoint=CKPT)) == 0
    assert spmd.train(mlp_config(run_dir, steps=3, checkpoint=CKPT)) == 0
    restored = next(e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "restored")
    assert restored["step"] == 2 and restored["source"] == "persistent", restored
    assert spmd.load(run_dir).step == 3
