"""Changing the recipe between jobs of one run (issue 21 item 6), in this process.

Another learning rate or schedule: the whole state is restored and the log (and a
`recipe_changed` event) says what changed. Another optimizer.name: an error naming both,
unless checkpoint.params_only, which restores the parameters alone (a fresh optimizer state)
and goes on from the checkpoint's step; a later job restores everything again.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import spmd
from spmd.errors import ConfigError
from spmd.loop.hooks import StepInfo
from tests.helpers.records import read_jsonl
from tests.helpers.training import mlp_config

pytestmark = pytest.mark.usefixtures("keep_signal_handlers")

CKPT = {"every": 4, "persistent_every": 4}


def config(run_dir, steps, optimizer=None, schedule=None, **checkpoint):
    return mlp_config(run_dir, steps=steps, checkpoint={**CKPT, **checkpoint},
                      optimizer=optimizer or {"lr": 3e-3},
                      schedule=schedule or {"name": "constant"})


def events(run_dir, name):
    return [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == name]


def test_a_new_schedule_keeps_the_optimizer_state_and_is_logged(run_dir):
    assert spmd.train(config(run_dir, 4)) == 0
    before = jax.tree.map(np.asarray, jax.device_get(spmd.load(run_dir).params))
    seen = {}

    def first(info: StepInfo) -> None:
        seen.setdefault("opt", jax.tree.map(np.asarray, jax.device_get(info.state.opt_state)))

    new = config(run_dir, 8, {"lr": 1e-3}, {"name": "cosine", "warmup_steps": 2})
    assert spmd.train(new, hooks=[(first, 1)]) == 0
    restored = events(run_dir, "restored")[-1]
    assert restored["step"] == 4 and "parameters only" not in restored["detail"]
    (changed,) = events(run_dir, "recipe_changed")
    assert changed["changes"]["optimizer.lr"] == [3e-3, 1e-3]
    assert changed["changes"]["schedule.name"] == ["constant", "cosine"]
    assert changed["changes"]["train.steps"] == [4, 8]
    log = (run_dir / "logs" / "rank00000.log").read_text()
    assert "the recipe changed since the previous job" in log
    assert "optimizer.lr 0.003 -> 0.001" in log
    # the restored adam state counts on from 4 (a fresh one would count 1 after step 5)
    counts = [int(x) for x in jax.tree.leaves(seen["opt"]) if x.dtype == np.int32 and not x.ndim]
    assert 5 in counts and 1 not in counts, counts
    lrs = {r["step"]: r["lr"] for r in read_jsonl(run_dir / "metrics.jsonl") if "lr" in r}
    assert lrs[2] == pytest.approx(3e-3) and lrs[5] < 1e-3   # the new cosine from step 4 on
    assert before   # the first job's parameters were there to restore


def test_another_optimizer_needs_params_only_and_then_restores_the_parameters(run_dir):
    assert spmd.train(config(run_dir, 4)) == 0
    saved = jax.tree.map(np.asarray, jax.device_get(spmd.load(run_dir).params))
    with pytest.raises(ConfigError, match="optimizer.name=adamw .*optimizer.name=sgd.*"
                                          "checkpoint.params_only=true"):
        spmd.train(config(run_dir, 8, {"name": "sgd", "lr": 0.01}))
    seen = {}

    def first(info: StepInfo) -> None:   # the state is donated to the next step: copy
        seen.setdefault(info.step, jax.tree.map(np.asarray, jax.device_get(info.state.params)))

    sgd = config(run_dir, 8, {"name": "sgd", "lr": 0.01, "momentum": 0.9}, params_only=True)
    assert spmd.train(sgd, hooks=[(first, 1)]) == 0
    restored = events(run_dir, "restored")[-1]
    assert restored["step"] == 4 and "parameters only" in restored["detail"]
    assert min(seen) == 5 and spmd.load(run_dir).step == 8
    # training went on from the checkpoint's parameters, not from a fresh initialization
    moved = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - b).max()),
                         seen[5], saved)
    assert max(jax.tree.leaves(moved)) < 0.1
    # a later job of the sgd run restores the whole state (momentum included)
    assert spmd.train(config(run_dir, 10, {"name": "sgd", "lr": 0.01, "momentum": 0.9},
                             params_only=True)) == 0
    last = events(run_dir, "restored")[-1]
    assert last["step"] == 8 and "parameters only" not in last["detail"]


def test_a_resumed_run_keeps_its_own_data_order(run_dir):
    """A job whose config leaves data.shuffle_block / data.shuffle_mix unset reads the
    order of the run's previous job (its config.yaml), and writes it to config.yaml again;
    a config.yaml from before data.shuffle_mix (shuffle_block unset: a full shuffle, blocks
    one at a time) reads as that order; a job that sets them trains on, warned."""
    import logging

    import yaml

    from spmd.config.load import config_from_dict
    from spmd.loop.recipe import keep_data_order

    assert spmd.train(config(run_dir, 4)) == 0
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["data"]["shuffle_block"] == "auto" and saved["data"]["shuffle_mix"] == 16
    cfg = config_from_dict(config(run_dir, 8))
    assert keep_data_order(cfg, run_dir) == (cfg, None)              # the same order
    old = {k: v for k, v in saved["data"].items() if k != "shuffle_mix"}
    (run_dir / "config.yaml").write_text(yaml.safe_dump({**saved, "data": {
        **old, "shuffle_block": None}}))                            # written by the old version
    kept, (level, line) = keep_data_order(cfg, run_dir)
    assert (kept.data.shuffle_block, kept.data.shuffle_mix) == (None, 1)
    assert level == logging.INFO and "data.shuffle_block=(unset), data.shuffle_mix=1" in line
    assert kept.train == cfg.train and kept.data.prefetch == cfg.data.prefetch
    chosen = config_from_dict({**config(run_dir, 8), "data": {"shuffle_block": 64}})
    same, (level, line) = keep_data_order(chosen, run_dir)
    assert same is chosen and level == logging.WARNING and "data order changed" in line
    full = config_from_dict({**config(run_dir, 8), "data": {"shuffle_block": "full"}})
    assert keep_data_order(full, run_dir) == (full, None)            # full = unset, mix 1
    (run_dir / "config.yaml").write_text(yaml.safe_dump({**saved, "data": {
        **old, "shuffle_block": 64}}))          # an old run that chose blocks: mix 1 then
    same_blocks = config_from_dict({**config(run_dir, 8), "data": {"shuffle_block": 64}})
    kept, (level, _) = keep_data_order(same_blocks, run_dir)
    assert (kept.data.shuffle_block, kept.data.shuffle_mix, level) == (64, 1, logging.INFO)
    (run_dir / "config.yaml").write_text(yaml.safe_dump({**saved, "data": {
        **old, "shuffle_block": None}}))
    assert spmd.train(config(run_dir, 8)) == 0                       # the old order goes on
    resumed = yaml.safe_load((run_dir / "config.yaml").read_text())["data"]
    assert (resumed["shuffle_block"], resumed["shuffle_mix"]) == (None, 1)
    assert "data order: the run's own" in (run_dir / "logs" / "rank00000.log").read_text()
    assert events(run_dir, "restored")[-1]["step"] == 4
