"""The `optimizer:` section: every optimizer trains, strict parameters, the weight-decay mask,
`module:function` and `Task.optimizer`, the deprecated `train.*` keys, sharded state."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from spmd.config.load import build_task, load_config
from spmd.config.schema import Config
from spmd.engine.axis_rules import axis_rules
from spmd.engine.mesh import build_mesh
from spmd.engine.state import make_optimizer, model_layout
from spmd.errors import ConfigError
from spmd.optim import OPTIMIZERS, PARAMETERS, OptimizerConfig, decays
from tests.helpers.env import REPO
from tests.helpers.training import runtime_for, train_steps

MLP = REPO / "configs" / "mlp_tiny.yaml"
TRANSFORMER = REPO / "configs" / "transformer_tiny.yaml"
# learning rates at which each optimizer visibly lowers the tiny MLP's loss in a few steps
LR = {"adamw": 3e-3, "adam": 3e-3, "sgd": 0.02, "lion": 1e-3, "adafactor": 1e-2, "muon": 0.02}


def my_sgd(learning_rate, momentum=0.0):
    """A `module:function` optimizer (tests.unit.optim.test_optimizers:my_sgd)."""
    return optax.sgd(learning_rate, momentum=momentum)


def test_optax_has_every_named_optimizer():
    assert set(PARAMETERS) == set(OPTIMIZERS)
    assert callable(optax.contrib.muon)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_every_optimizer_trains_the_mlp_under_fsdp_on_8_devices(name):
    """Each optimizer lowers the loss, its state sharded like the parameters (fsdp splits
    every parameter; adafactor factors them: its row/column statistics get fitted specs)."""
    extra = {"adafactor": ["optimizer.min_dim_size_to_factor=8"],
                 "sgd": ["optimizer.momentum=0.9"]}.get(name, [])
    cfg = load_config(MLP, [f"optimizer.name={name}", f"optimizer.lr={LR[name]}",
                            "optimizer.weight_decay=0.01", "train.steps=8",
                            "mesh.strategy=fsdp", "mesh.fsdp_min_bytes=0", *extra])
    rt = runtime_for(cfg, build_mesh(cfg.mesh, jax.devices()))
    losses, state = train_steps(rt, 8)
    assert np.isfinite(losses).all() and losses[-1] < 0.9 * losses[0], (name, losses)
    # every optimizer-state array lives where its sharding says, and the moments of a
    # parameter split over fsdp are split too (not replicated)
    leaves = jax.tree.leaves(state.opt_state)
    shardings = jax.tree.leaves(rt.state.shardings.opt_state)
    assert all(x.sharding == s for x, s in zip(leaves, shardings))
    assert any(not s.is_fully_replicated for s in shardings if len(s.spec)), name


def test_adafactor_factored_moments_take_the_parameters_spec_less_a_dimension():
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from spmd.optim.state_sharding import opt_state_shardings

    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"), devices=jax.devices()[:8])
    params = {"w": jax.ShapeDtypeStruct((256, 512), jnp.float32),
              "stack": jax.ShapeDtypeStruct((4, 256, 512), jnp.float32),
              "b": jax.ShapeDtypeStruct((512,), jnp.float32)}
    specs = {"w": P("fsdp", "tensor"), "stack": P(None, "fsdp", "tensor"), "b": P("tensor")}
    shardings = {k: NamedSharding(mesh, v) for k, v in specs.items()}
    cfg = Config.model_validate({"optimizer": {"name": "adafactor"}})
    tx = make_optimizer(cfg)
    abstract = jax.eval_shape(tx.init, params)
    got = opt_state_shardings(tx, abstract, shardings, params, NamedSharding(mesh, P()))
    pairs = {(tuple(a.shape), tuple(s.spec)) for a, s in
             zip(jax.tree.leaves(abstract), jax.tree.leaves(got))}
    # row/column statistics: the parameter's spec less the factored dimension
    assert {((256,), ("fsdp",)), ((512,), ("tensor",)), ((4, 256), (None, "fsdp")),
            ((4, 512), (None, "tensor"))} <= pairs
    assert ((1,), ()) in pairs   # placeholders are replicated
    # and they land there
    state = jax.jit(tx.init, out_shardings=got)(
        {k: jnp.zeros(v.shape) for k, v in params.items()})
    assert all(x.sharding == s for x, s in zip(jax.tree.leaves(state), jax.tree.leaves(got)))


@pytest.mark.parametrize("overrides, message", [
    (["optimizer.name=sgd", "optimizer.b1=0.9"], "not a parameter of optimizer.name=sgd "
                                                 r"\(its parameters: momentum, nesterov"),
    (["optimizer.name=adamw", "optimizer.momentum=0.9"], "b1, b2, eps, eps_root"),
    (["optimizer.name=rmsprop"], "adamw, adam, sgd, lion, adafactor, muon or module:function"),
    (["optimizer.nesterv=true"], "did you mean 'optimizer.nesterov'"),
    (["optimizer.kwargs={a: 1}"], "optimizer.kwargs is for a module:function"),
])
def test_a_wrong_optimizer_key_names_the_valid_ones(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(MLP, overrides)


def test_optimizer_parameters_reach_optax():
    cfg = Config.model_validate({"optimizer": {"name": "sgd", "lr": 0.5, "momentum": 0.9,
                                               "grad_clip": None}})
    tx = make_optimizer(cfg)
    params = {"w": jnp.zeros(2)}
    state = tx.init(params)
    moves = []
    for _ in range(2):
        updates, state = tx.update({"w": jnp.ones(2)}, state, params)
        moves.append(float(-updates["w"][0]))
    assert moves == pytest.approx([0.5, 0.5 * 1.9])


def test_module_function_optimizer_and_its_kwargs():
    cfg = Config.model_validate({"optimizer": {
        "name": "tests.unit.optim.test_optimizers:my_sgd", "lr": 0.5, "grad_clip": None,
        "kwargs": {"momentum": 0.9}}})
    tx = make_optimizer(cfg)
    state = tx.init({"w": jnp.zeros(1)})
    updates, state = tx.update({"w": jnp.ones(1)}, state)
    updates, _ = tx.update({"w": jnp.ones(1)}, state)
    assert float(-updates["w"][0]) == pytest.approx(0.5 * 1.9)
    bad = Config.model_validate({"optimizer": {"name": "tests.unit.optim.test_optimizers:nothing"}})
    with pytest.raises(ConfigError, match="cannot import"):
        make_optimizer(bad)
    with pytest.raises(ConfigError, match="optimizer.b1 is a parameter of the built-in"):
        load_config(MLP, ["optimizer.name=tests.unit.optim.test_optimizers:my_sgd",
                          "optimizer.b1=0.9"])


def test_a_tasks_optimizer_method_replaces_the_section():
    cfg = load_config(MLP, ["optimizer.name=lion", "optimizer.grad_clip=null"])
    task = build_task(cfg)
    seen = []

    def own(schedule):
        seen.append(float(schedule(0)))
        return optax.sgd(schedule)

    task.optimizer = own
    tx = make_optimizer(cfg, task)
    updates, _ = tx.update({"w": jnp.full(1, 2.0)}, tx.init({"w": jnp.zeros(1)}))
    assert seen == [pytest.approx(3e-3)]
    assert float(updates["w"][0]) == pytest.approx(-2 * 3e-3)   # sgd, not lion's sign


def transformer_decays(*overrides: str) -> dict[str, bool]:
    cfg = load_config(TRANSFORMER, list(overrides))
    mesh = build_mesh(cfg.mesh, jax.devices()[:1])
    task = build_task(cfg)
    layout = model_layout(task, 0, axis_rules(cfg.mesh, task), mesh)
    return {p.path: decays(p.path, len(p.shape), tuple(p.logical_axes), cfg.optimizer.no_decay)
            for p in layout.report.params}


def test_default_mask_exempts_norms_biases_and_embeddings_of_the_transformer():
    got = transformer_decays()
    exempt = {p for p, d in got.items() if not d}
    assert exempt == {"embedding", "final_norm/scale", "blocks/attn_norm/scale",
                      "blocks/mlp_norm/scale"}, got
    assert got["unembed/kernel"] and got["blocks/mlp/up/kernel"] and got["blocks/attn/query"]
    # unstacked layers: the same answer per layer
    unstacked = transformer_decays("model.scan_layers=false")
    assert not unstacked["blocks/0/attn_norm/scale"] and unstacked["blocks/1/mlp/down/kernel"]
    # learned positions are an embedding too
    assert not transformer_decays("model.positions=learned")["position"]


def test_no_decay_overrides_the_default_by_glob_and_logical_axis():
    got = transformer_decays("optimizer.no_decay=[blocks/attn/*, 'axis:vocab']")
    assert not got["blocks/attn/query"] and not got["unembed/kernel"] and not got["embedding"]
    assert got["final_norm/scale"] and got["blocks/mlp/up/kernel"]   # the default is off
    with_default = transformer_decays("optimizer.no_decay=[default, '*/up/*']")
    assert not with_default["final_norm/scale"] and not with_default["blocks/mlp/up/kernel"]
    assert with_default["blocks/mlp/down/kernel"]


def test_weight_decay_shrinks_only_the_masked_parameters():
    for name in ("adamw", "sgd", "lion", "adafactor", "muon"):
        cfg = Config.model_validate({"optimizer": {"name": name, "lr": 0.1,
                                                   "weight_decay": 0.5, "grad_clip": None}})
        tx = make_optimizer(cfg)
        params = {"kernel": jnp.ones((4, 4)), "bias": jnp.ones(4)}
        updates, _ = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
        assert float(jnp.abs(updates["bias"]).max()) == 0.0, name
        assert float(updates["kernel"].max()) < 0.0, name


def test_deprecated_train_keys_still_work_with_one_warning_each(caplog):
    from spmd.config import schema

    schema._warned.clear()
    with caplog.at_level(logging.WARNING, logger="spmd.config"):
        cfg = load_config(None, ["train.lr=0.01", "train.warmup_steps=3",
                                 "train.weight_decay=0.1", "train.grad_clip=null"])
        load_config(None, ["train.lr=0.02"])
    assert (cfg.optimizer.lr, cfg.schedule.warmup_steps) == (0.01, 3)
    assert (cfg.optimizer.weight_decay, cfg.optimizer.grad_clip) == (0.1, None)
    lines = [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]
    assert len(lines) == 4 and "use optimizer.lr" in lines[0]
    assert "train.lr" not in cfg.to_yaml().split("optimizer:")[0]
    with pytest.raises(ConfigError, match="remove train.lr"):
        load_config(None, ["train.lr=0.01", "optimizer.lr=0.02"])


def test_optimizer_section_round_trips_through_config_yaml(tmp_path: Path):
    cfg = load_config(MLP, ["optimizer.name=adafactor", "optimizer.decay_rate=0.9",
                            "schedule.name=wsd"])
    path = tmp_path / "config.yaml"
    path.write_text(cfg.to_yaml())
    again = load_config(path)
    assert again.optimizer == cfg.optimizer and again.schedule == cfg.schedule
    assert isinstance(again.optimizer, OptimizerConfig)


def test_spmd_optimizer_prints_the_recipe_and_what_decays():
    from tests.helpers.env import run_spmd

    r = run_spmd("optimizer", str(TRANSFORMER), "optimizer.weight_decay=0.1",
                 "schedule.name=cosine", "schedule.warmup_steps=4", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads(r.stdout)
    assert d["optimizer"]["name"] == "adamw" and d["schedule"]["name"] == "cosine"
    assert d["lr"]["5"] == pytest.approx(3e-3) and d["lr"]["1"] == 0.0
    decaying = {p["path"] for p in d["params"] if p["decays"]}
    assert "unembed/kernel" in decaying and "embedding" not in decaying
    text = run_spmd("optimizer", str(TRANSFORMER), "optimizer.weight_decay=0.1")
    assert text.returncode == 0 and "no decay  final_norm/scale" in text.stdout


def test_the_documented_recipe_is_a_valid_config():
    """docs/recipes.md's complete recipe, as printed, is a config with the stated rates."""
    import re

    import yaml

    from spmd.config.load import _merge as merge
    from spmd.config.load import config_from_dict
    from spmd.engine.state import learning_rate

    section = (REPO / "docs" / "recipes.md").read_text().split("## A complete recipe", 1)[1]
    section = section.split("\n## ", 1)[0]
    (block,) = re.findall(r"```yaml\n(.*?)```", section, re.S)
    raw = merge(yaml.safe_load(TRANSFORMER.read_text()), yaml.safe_load(block))
    cfg = config_from_dict(raw)
    assert cfg.train.grad_accum == 4 and cfg.train.ema_decay == 0.999
    schedule = learning_rate(cfg)
    assert float(schedule(100)) == pytest.approx(3e-4)
    assert float(schedule(2000)) == pytest.approx(3e-5)


@pytest.mark.usefixtures("keep_signal_handlers")
@pytest.mark.parametrize("name", ["adafactor", "muon"])
def test_factored_and_partitioned_states_checkpoint_and_resume(tmp_path, name):
    """adafactor's factored moments and muon's partitioned state (MaskedNode places) go
    through both tiers and restore onto another mesh."""
    import spmd
    from tests.helpers.records import read_jsonl
    from tests.helpers.training import mlp_config

    run_dir = tmp_path / "run"
    opt = {"name": name, **({"min_dim_size_to_factor": 8} if name == "adafactor" else {})}
    ckpt = {"every": 2, "persistent_every": 2}
    assert spmd.train(mlp_config(run_dir, steps=2, optimizer=opt, checkpoint=ckpt,
                                 mesh={"strategy": "fsdp", "fsdp_min_bytes": 0})) == 0
    assert spmd.train(mlp_config(run_dir, steps=4, optimizer=opt, checkpoint=ckpt,
                                 mesh={"strategy": "dp"})) == 0
    restored = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "restored"]
    assert [e["step"] for e in restored] == [2]
    assert spmd.load(run_dir).step == 4
