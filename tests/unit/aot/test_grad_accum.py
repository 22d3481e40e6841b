"""Gradient accumulation (issue 21 item 3), in this process on 8 CPU devices.

`train.grad_accum: K` splits each global batch into K microbatches inside the jitted step
(a scan, gradients summed in float32) and applies one update: the losses, aux metrics and
parameters equal K = 1 on the same global batch under dp and spatial here (fsdp and tp on
2 ranks x 4 devices: tests/multiprocess/test_recipe_parallel.py); every microbatch stays
sharded like the batch (no collective moves batch rows); the step's temporary memory falls
with K; and the config errors name the keys to change.
"""

from __future__ import annotations

import re
from collections import Counter

import jax
import numpy as np
import pytest

from spmd.aot.plan import make_plan
from spmd.config.load import load_config
from spmd.engine.mesh import build_mesh
from spmd.errors import ConfigError
from tests.helpers.env import REPO
from tests.helpers.fno import make_tiny_dataset, tiny_config
from tests.helpers.training import runtime_for

pytestmark = pytest.mark.slow   # trains or compiles: the full suite, not -m 'not slow'

LM = REPO / "configs" / "transformer_tiny.yaml"
MLP = REPO / "configs" / "mlp_tiny.yaml"
SMALL_LM = ["model.num_layers=1", "model.d_model=32", "model.num_heads=4", "model.d_ff=64",
            "model.seq_len=8", "model.vocab_size=64", "train.batch_size=32"]
STEPS = 3
MOVES = re.compile(r"\b(all-to-all|collective-permute|all-gather)(?:-start)?\(")


def collectives(hlo: str) -> Counter:
    """How many of each collective that moves data between devices a compiled step has."""
    return Counter(m.group(1) for m in MOVES.finditer(hlo))


def runtime(config, *overrides):
    cfg = load_config(config, list(overrides))
    rt = runtime_for(cfg, build_mesh(cfg.mesh, jax.devices()))
    rt.task.prepare(True)
    return rt


def trained(rt) -> tuple[list[dict], dict]:
    """Metrics of every step and the final parameters (host arrays), from rt.init()."""
    state, source, history = rt.init(), rt.task.train_source(), []
    for step in range(STEPS):
        state, metrics = rt.train_step(state, rt.feed.global_batch(source, step))
        history.append({k: float(v) for k, v in metrics.items()})
    return history, jax.tree.map(np.asarray, jax.device_get(state.params))


def assert_same_training(one, many) -> None:
    (h1, p1), (hk, pk) = one, many
    for m1, mk in zip(h1, hk):
        for key in ("loss", "grad_norm", *[k for k in m1 if k.startswith("acc")]):
            np.testing.assert_allclose(mk[key], m1[key], rtol=1e-5, err_msg=key)
    # float32 gradients summed in another order differ by a few 1e-7 after the updates
    # (parameters of about 1e-2); a wrong or missing microbatch moves them by far more
    jax.tree.map(lambda a, b: np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6), p1, pk)


def test_four_microbatches_equal_one_batch_and_move_no_rows():
    """dp on 8 devices (fsdp and tp: tests/multiprocess/test_recipe_parallel.py, 2 ranks)."""
    overrides = [*SMALL_LM, "mesh.strategy=dp"]
    one = runtime(LM, *overrides)
    many = runtime(LM, *overrides, "train.grad_accum=4")
    result = trained(many)
    assert "accuracy" in result[0][0]          # the task's aux metric, averaged too
    assert_same_training(trained(one), result)

    # Every microbatch is the device's own rows: dp replicates the parameters, so a step
    # that moved no batch rows has no gather, all-to-all or permute at all.
    assert not collectives(many.compile_train_step()[0].as_text())


def test_spatial_fno_four_microbatches_equal_one_batch(tmp_path):
    config = tiny_config(tmp_path, make_tiny_dataset(tmp_path / "darcy.h5"))
    overrides = ["mesh.strategy=spatial", "mesh.axes.data=2", "mesh.axes.context=4",
                 "train.eval_every=0"]
    one = runtime(config, *overrides)
    many = runtime(config, *overrides, "train.grad_accum=4")
    assert_same_training(trained(one), trained(many))


def test_activation_memory_falls_with_grad_accum():
    """`spmd plan`'s temporary bytes (the compiled step's scratch: activations kept for the
    backward pass) with K = 4 microbatches are well below K = 1's."""
    overrides = ["model.d_hidden=512", "train.batch_size=4096", "mesh.strategy=dp"]
    plans = {}
    for k in (1, 4):
        cfg = load_config(MLP, [*overrides, f"train.grad_accum={k}"])
        plans[k] = make_plan(cfg, build_mesh(cfg.mesh, jax.devices()))
    assert plans[4].grad_accum == 4
    assert plans[4].temp_bytes < 0.6 * plans[1].temp_bytes, (plans[1].temp_bytes,
                                                             plans[4].temp_bytes)
    assert "one of 4 accumulated microbatches" in plans[4].as_text()


def test_batch_not_divisible_by_microbatches_and_data_ways_names_both_keys():
    with pytest.raises(ConfigError) as e:
        runtime(LM, "train.batch_size=16", "train.grad_accum=4")   # 8 data ways x 4 > 16
    message = str(e.value)
    assert "train.batch_size=16" in message and "train.grad_accum=4" in message
    assert "8 data-parallel ways" in message and "\n" not in message


def test_grad_accum_with_a_pipeline_is_an_error_naming_both_keys():
    with pytest.raises(ConfigError) as e:
        runtime(LM, "mesh.strategy=pp", "mesh.axes.stage=2", "mesh.axes.data=4",
                "train.microbatches=2", "train.grad_accum=2")
    message = str(e.value)
    assert "train.grad_accum=2" in message and "train.microbatches" in message
    assert "\n" not in message
