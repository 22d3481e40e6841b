"""Issue 13: pipeline parallelism over `stage` (GPipe and 1F1B) on 8 CPU devices.

Losses and updated parameters equal one device's; the stacked block parameters really live
on `stage`; bad configurations are one-line errors naming their keys; the schedules keep
what they promise (bubble formula, 1F1B's bounded stash, stage-to-stage collective-permutes).

Cases, one compile each: GPipe and 1F1B on pp stage=4 x data=2, 1F1B on pp stage=2 x data=4
(M = 8) and on pp_fsdp (SCHEDULES); circular GPipe (repeats=2) on pp with M = 2 S and on
pp_fsdp with M = S (CIRCULAR). Every 4-layer case shares one one-device reference.
The `spmd` commands (bad configs, the shardings report) run in one child process.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from spmd.config.load import load_config
from spmd.engine.mesh import build_mesh
from spmd.sharding.one_f_one_b import tick_phase
from spmd.sharding.pipeline import bubble_fraction
from tests.helpers.cli_batch import run_batch
from tests.helpers.env import REPO, clean_env
from tests.helpers.training import runtime_for, train_steps

pytestmark = pytest.mark.slow   # trains or compiles: the full suite, not -m 'not slow'

CONFIG = REPO / "configs" / "transformer_tiny.yaml"
STEPS = 4
LAYERS = ("model.num_layers=4", "model.attention=xla", f"train.steps={STEPS}")


def make(strategy: str, devices, *overrides: str):
    cfg = load_config(CONFIG, [f"mesh.strategy={strategy}", *LAYERS, *overrides])
    return runtime_for(cfg, build_mesh(cfg.mesh, devices))


_REFERENCE: dict[tuple[str, ...], tuple[list[float], dict]] = {}


def reference(*overrides: str) -> tuple[list[float], dict]:
    """One device's losses and final parameters (cached per batch override)."""
    if overrides not in _REFERENCE:
        losses, state = train_steps(make("dp", jax.devices()[:1], *overrides), STEPS)
        assert losses[-1] < losses[0]
        _REFERENCE[overrides] = losses, jax.device_get(state.params)
    return _REFERENCE[overrides]


MESHES = {
    "pp-stage4-data2-m4": ("pp", "mesh.axes.stage=4", "mesh.axes.data=2",
                           "train.microbatches=4"),
    # 8 microbatches x 4 data ways need a batch of at least 32 rows
    "pp-stage2-data4-m8": ("pp", "mesh.axes.stage=2", "mesh.axes.data=4",
                           "train.microbatches=8", "train.batch_size=32"),
    "pp_fsdp-stage2-fsdp4-m2": ("pp_fsdp", "mesh.axes.stage=2", "mesh.axes.fsdp=4",
                                "train.microbatches=2"),
}


# Both schedules on one mesh, 1F1B on the other two (GPipe also runs on pp_fsdp in the
# circular test below): every mesh and every schedule, without compiling all six pairs.
SCHEDULES = [("pp-stage4-data2-m4", "gpipe"), ("pp-stage4-data2-m4", "1f1b"),
             ("pp-stage2-data4-m8", "1f1b"), ("pp_fsdp-stage2-fsdp4-m2", "1f1b")]


@pytest.mark.parametrize("case,schedule", SCHEDULES, ids=[f"{c}-{s}" for c, s in SCHEDULES])
def test_pipeline_matches_one_device(case, schedule):
    strategy, *overrides = MESHES[case]
    ref_losses, ref_params = reference(*(o for o in overrides if o.startswith("train.batch")))
    rt = make(strategy, jax.devices(), *overrides, f"train.pipeline_schedule={schedule}")
    assert rt.mesh.size == 8
    losses, state = train_steps(rt, STEPS)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
    # the same updated parameters (Adam amplifies float-order noise in tiny gradients a bit)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-3, atol=2e-5),
                 jax.device_get(state.params), ref_params)
    up = state.params["blocks"]["mlp"]["up"]["kernel"]          # (layers, embed, mlp)
    assert up.sharding.spec[0] == "stage"
    per_device = {s.data.shape for s in up.addressable_shards}
    assert per_device == {(4 // rt.mesh.shape["stage"],
                           *((up.shape[1] // 4,) if strategy == "pp_fsdp" else (up.shape[1],)),
                           up.shape[2])}
    if strategy == "pp_fsdp":
        assert up.sharding.spec == P("stage", "fsdp")
        assert state.params["embedding"].sharding.spec == P(None, "fsdp")
    else:
        assert state.params["embedding"].sharding.spec in (P(), P(None, None))


CIRCULAR = {
    # 4 layers in 4 chunks: stage k runs layers k and k + 2; M = 2 S microbatches (pp_fsdp
    # below runs M = S). The 4 layers share the one-device reference of the tests above.
    "pp-stage2-data4-m4-r2": ("pp", "mesh.axes.stage=2", "mesh.axes.data=4",
                              "train.microbatches=4"),
    "pp_fsdp-stage2-fsdp4-m2-r2": ("pp_fsdp", "mesh.axes.stage=2", "mesh.axes.fsdp=4",
                                   "train.microbatches=2"),
}


@pytest.mark.parametrize("case", list(CIRCULAR))
def test_circular_pipeline_matches_one_device(case):
    """train.pipeline_repeats=2: each microbatch goes round the stages twice, and the stored
    parameters keep layer order (still on `stage` by contiguous blocks)."""
    strategy, *overrides = CIRCULAR[case]
    ref_losses, ref_params = reference(*(o for o in overrides if o.startswith("model.")))
    rt = make(strategy, jax.devices(), *overrides, "train.pipeline_repeats=2")
    assert rt.pipeline.repeats == 2
    losses, state = train_steps(rt, STEPS)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-3, atol=2e-5),
                 jax.device_get(state.params), ref_params)
    assert state.params["blocks"]["mlp"]["up"]["kernel"].sharding.spec[0] == "stage"


@pytest.mark.parametrize("overrides,needles", [
    (("mesh.axes.stage=2", "mesh.axes.data=4", "train.pipeline_repeats=4"),
     ("model.num_layers=4", "train.pipeline_repeats=4", "mesh.axes.stage=2")),
    (("mesh.axes.stage=2", "mesh.axes.data=4", "train.pipeline_repeats=2",
      "train.microbatches=2", "train.pipeline_schedule=1f1b"),
     ("train.pipeline_repeats=2", "train.pipeline_schedule=gpipe", "1f1b")),
    (("mesh.axes.stage=4", "mesh.axes.data=2", "model.num_layers=8",
      "train.pipeline_repeats=2", "train.microbatches=2"),
     ("train.pipeline_repeats=2", "train.microbatches=2", "multiple of 4")),
], ids=["layers-not-divisible-by-stages-x-repeats", "repeats-with-1f1b",
        "microbatches-not-a-multiple-of-stages"])
def test_bad_circular_configs_name_their_keys(overrides, needles):
    from spmd.errors import ConfigError

    cfg = load_config(CONFIG, ["mesh.strategy=pp", *LAYERS, *overrides])
    with pytest.raises(ConfigError) as err:
        runtime_for(cfg, build_mesh(cfg.mesh, jax.devices()))
    message = str(err.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, (needle, message)


def test_pipeline_composes_with_tensor():
    """pp with mesh.axes.tensor=2 and Megatron rules for mlp/heads: still one device's losses."""
    ref = reference()[0][:2]
    rt = make("pp", jax.devices(), "mesh.axes.stage=2", "mesh.axes.data=2", "mesh.axes.tensor=2",
              "mesh.rules.mlp=tensor", "mesh.rules.heads=tensor", "train.microbatches=2")
    losses = train_steps(rt, 2)[0]
    np.testing.assert_allclose(losses, ref, rtol=1e-4)
    assert rt.state.shardings.params["blocks"]["mlp"]["up"]["kernel"].spec == \
        P("stage", None, "tensor")


PP = ("mesh.strategy=pp", "mesh.axes.stage=2", "mesh.axes.data=4")
COMMANDS = {   # name -> spmd arguments ({run}: a run directory of its own)
    "json": ("shardings", str(CONFIG), "mesh.strategy=pp", "mesh.axes.stage=4",
             "mesh.axes.data=2", "model.num_layers=4", "--json"),
    **{f"layers-{command}": (command, str(CONFIG), "mesh.strategy=pp", "mesh.axes.stage=4",
                             "mesh.axes.data=2", "model.num_layers=6", "run.dir={run}")
       for command in ("train", "shardings")},
    "batch": ("train", str(CONFIG), *PP, "model.num_layers=4", "train.microbatches=8",
              "train.batch_size=16", "run.dir={run}"),
    "unstacked-transformer": ("train", str(CONFIG), *PP, "model.scan_layers=false",
                              "model.num_layers=4", "run.dir={run}"),
    "mlp": ("train", str(REPO / "configs" / "mlp_tiny.yaml"), *PP, "run.dir={run}"),
}


@pytest.fixture(scope="module")
def cli(tmp_path_factory) -> dict:
    """The `spmd` commands of the tests below on 8 devices, in one child process
    (tests/helpers/cli_batch.py) instead of one Python start each."""
    env = clean_env(JAX_NUM_CPU_DEVICES="8", SPMD_MPI="0")
    tmp = tmp_path_factory.mktemp("pipeline_cli")
    cases = [(env, [a.format(run=tmp / name) for a in args]) for name, args in COMMANDS.items()]
    return dict(zip(COMMANDS, run_batch(cases)))


def test_shardings_json_puts_stacked_blocks_on_stage(cli):
    r = cli["json"]
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    rows = report["params"] if isinstance(report, dict) else report
    blocks = [p for p in rows if p["path"].startswith("blocks/")]
    assert blocks and all(p["spec"][0] == "stage" for p in blocks), blocks
    assert all(p["logical_axes"][0] == "layers" for p in blocks)
    others = [p for p in rows if not p["path"].startswith("blocks/")]
    assert others and all("stage" not in json.dumps(p["spec"]) for p in others)


def _assert_one_line_error(r, *needles: str) -> None:
    assert r.returncode != 0, r.stdout
    assert "Traceback" not in r.stderr, r.stderr
    lines = [line for line in r.stderr.strip().splitlines() if "error" in line]
    assert len(lines) == 1, r.stderr
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"


@pytest.mark.parametrize("command", ["train", "shardings"])
def test_layers_not_divisible_by_stages(command, cli):
    _assert_one_line_error(cli[f"layers-{command}"], "model.num_layers=6", "mesh.axes.stage=4")


def test_batch_not_divisible_by_microbatches_times_data(cli):
    _assert_one_line_error(cli["batch"], "train.batch_size=16", "train.microbatches=8",
                           "data=4")


@pytest.mark.parametrize("model", ["unstacked-transformer", "mlp"])
def test_model_without_stacked_layers_under_pp(model, cli):
    r = cli[model]
    _assert_one_line_error(r, "mesh.strategy=pp", "'layers'", "mesh.axes.stage=2")
    if model == "unstacked-transformer":
        assert "model.scan_layers=true" in r.stderr


@pytest.mark.parametrize("key", ["microbatches", "pipeline_repeats"])
def test_microbatches_without_pipeline_is_an_error(key):
    cfg = load_config(CONFIG, [f"train.{key}=2"])
    from spmd.errors import ConfigError

    with pytest.raises(ConfigError, match=rf"train\.{key}=2 needs pipeline stages"):
        runtime_for(cfg, build_mesh(cfg.mesh, jax.devices()))


def test_bubble_formula():
    assert bubble_fraction(4, 8, repeats=2) == pytest.approx(3 / 19)   # (S-1)/(R M + S-1)
    assert bubble_fraction(1, 8) == 0.0
    assert bubble_fraction(4, 1) == pytest.approx(3 / 4)
    assert bubble_fraction(4, 4) == pytest.approx(3 / 7)
    assert bubble_fraction(2, 8) == pytest.approx(1 / 9)


@pytest.mark.parametrize("s,m", [(2, 1), (2, 8), (4, 1), (4, 2), (4, 8), (8, 3)])
def test_1f1b_phases_skip_only_bubble_and_give_the_textbook_bubble(s, m):
    """Every valid forward and backward slot falls in a tick whose phase runs it, and the
    ticks that run each kind of slot number M + S - 1: so the bubble is (S-1)/(M+S-1)."""
    ticks = m + 2 * s - 2
    phases = [int(tick_phase(t, s, m)) for t in range(ticks)]
    runs_forward = [p in (0, 1) for p in phases]
    runs_backward = [p in (1, 2) for p in phases]
    for t in range(ticks):
        for k in range(s):
            if 0 <= t - k < m:                          # stage k's forward of t - k
                assert runs_forward[t], (t, k)
            if 0 <= t - (2 * s - 2 - k) < m:            # stage k's backward
                assert runs_backward[t], (t, k)
    assert sum(runs_forward) == sum(runs_backward) == m + s - 1
    assert phases == sorted(phases) and phases.count(1) == m   # warm-up, steady, cool-down
    # per stage: M useful slots of each kind out of M + S - 1 ticks of that kind
    assert 1 - m / sum(runs_forward) == pytest.approx(bubble_fraction(s, m))
