"""Mixed precision (issue 21 item 4), in this process on 8 CPU devices.

`model.dtype` is the compute dtype, `model.param_dtype` the stored (master) parameters'.
bf16 compute with float32 master weights trains the tiny transformer and its parameters,
optimizer moments and EMA stay float32; the loss and the gradient norm are float32 whatever
the dtypes; bf16-stored parameters keep a float32 EMA.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from spmd.config.load import load_config
from spmd.engine.mesh import build_mesh
from tests.helpers.env import REPO
from tests.helpers.training import runtime_for, train_steps

pytestmark = pytest.mark.slow   # trains or compiles: the full suite, not -m 'not slow'

LM = REPO / "configs" / "transformer_tiny.yaml"
SMALL = ["model.num_layers=1", "model.d_model=32", "model.num_heads=4", "model.d_ff=64",
         "model.seq_len=16", "model.vocab_size=64", "train.batch_size=16",
         "train.ema_decay=0.9"]


def runtime(*overrides):
    cfg = load_config(LM, [*SMALL, *overrides])
    return runtime_for(cfg, build_mesh(cfg.mesh, jax.devices()))


def float_dtypes(tree) -> set:
    return {np.dtype(x.dtype).name for x in jax.tree.leaves(tree)
            if jnp.issubdtype(x.dtype, jnp.floating)}


def test_bf16_compute_with_float32_master_params_trains_and_params_stay_float32():
    rt = runtime("model.dtype=bfloat16", "model.param_dtype=float32", "train.grad_accum=2")
    lowered = rt.train_step.lower(rt.state.abstract, rt.abstract_batch()).as_text()
    assert "bf16" in lowered                              # the matmuls do run in bf16
    losses, state = train_steps(rt, 8)
    assert all(np.isfinite(losses)) and losses[-1] < losses[0], losses
    assert float_dtypes(state.params) == {"float32"}
    assert float_dtypes(state.opt_state) == {"float32"}
    assert float_dtypes(state.ema) == {"float32"}
    _, metrics = rt.train_step(state, rt.feed.global_batch(rt.task.train_source(), 8))
    assert metrics["loss"].dtype == jnp.float32 and metrics["grad_norm"].dtype == jnp.float32


@pytest.mark.parametrize("model", ["transformer", "mlp", "fno"])
def test_param_dtype_sets_the_stored_dtype_of_every_builtin_model(model, tmp_path):
    """Abstractly (nothing compiled): every floating parameter is stored in param_dtype."""
    from spmd.config.load import build_task, config_from_dict
    from spmd.engine.axis_rules import axis_rules
    from spmd.engine.state import model_layout
    from spmd.inference.loading import single_device_mesh

    extra = {"fno": {"grid": 16, "modes": 4, "width": 8}}.get(model, {})
    cfg = config_from_dict({"run": {"dir": str(tmp_path)},
                            "model": {"name": model, "param_dtype": "bfloat16",
                                      "dtype": "bfloat16", **extra}})
    task = build_task(cfg)
    mesh = single_device_mesh()
    layout = model_layout(task, 0, axis_rules(cfg.mesh, task), mesh)
    assert float_dtypes(nnx.to_pure_dict(layout.abstract_params)) == {"bfloat16"}


def test_bf16_params_keep_a_float32_ema_and_float32_reductions():
    cfg = load_config(REPO / "configs" / "mlp_tiny.yaml",
                      ["model.dtype=bfloat16", "model.param_dtype=bfloat16",
                       "train.ema_decay=0.9", "model.num_layers=1"])
    rt = runtime_for(cfg, build_mesh(cfg.mesh, jax.devices()))
    losses, state = train_steps(rt, 3)
    assert all(np.isfinite(losses))
    assert float_dtypes(state.params) == {"bfloat16"}
    assert float_dtypes(state.ema) == {"float32"}
    evaluated = rt.eval_params(state)                     # no eval_ema: the params
    assert float_dtypes(evaluated) == {"bfloat16"}
    _, metrics = rt.train_step(state, rt.feed.global_batch(rt.task.train_source(), 3))
    assert metrics["loss"].dtype == jnp.float32 and metrics["grad_norm"].dtype == jnp.float32
