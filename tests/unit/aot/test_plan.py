"""`spmd plan`: ahead-of-time memory/FLOPs/collectives, checked against a real run.

The `spmd plan --devices 8` commands on the CPU backend run in one child process (the
`plans_on_8` fixture, tests/helpers/cli_batch.py); other device counts, and the plan that
looks for a GPU itself, each need a process of their own.
"""

from __future__ import annotations

import json

import jax
import pytest

from spmd.aot.plan import collectives_from_hlo, make_plan
from spmd.aot.topologies import gpu_target_config
from spmd.config.load import load_config
from spmd.engine.mesh import build_mesh
from tests.helpers.cli_batch import run_batch
from tests.helpers.env import REPO, clean_env, run_spmd
from tests.helpers.training import runtime_for

pytestmark = pytest.mark.slow   # trains or compiles: the full suite, not -m 'not slow'

CONFIG = REPO / "configs" / "transformer_tiny.yaml"

def plan_mesh(cfg):
    return build_mesh(cfg.mesh, jax.devices())


def device0_bytes(arrays) -> int:
    device = jax.devices()[0]
    return sum(s.data.nbytes for a in arrays for s in a.addressable_shards if s.device == device)


def test_plan_memory_matches_a_measured_run():
    """One real fsdp step on 8 devices: what device 0 then holds is the plan's resident bytes."""
    cfg = load_config(CONFIG, ["mesh.strategy=fsdp"])
    rt = runtime_for(cfg, build_mesh(cfg.mesh, jax.devices()))
    plan = make_plan(cfg, rt.mesh, runtime=rt)

    before = jax.live_arrays()          # held, so nothing of other tests is counted as new
    known = {id(a) for a in before}
    state = rt.init()
    batch = rt.feed.global_batch(rt.task.train_source(), 0)
    state, metrics = rt.train_step(state, batch)
    jax.block_until_ready((state, metrics))
    new = [a for a in jax.live_arrays() if id(a) not in known]
    live = device0_bytes(new)           # state after the step + batch + metrics

    # From the shardings: exact.
    assert plan.param_bytes == device0_bytes(jax.tree.leaves(state.params))
    assert plan.optimizer_bytes == device0_bytes(jax.tree.leaves(state.opt_state))
    assert plan.param_bytes == rt.model.report.bytes_per_device
    # From the compiled executable (arguments + outputs - donated aliases): within 10%.
    assert abs(plan.resident_bytes - live) <= 0.10 * live, (plan.resident_bytes, live)
    assert plan.alias_bytes >= plan.state_bytes        # donation: new state reuses the old
    assert plan.peak_bytes > plan.resident_bytes
    del before


def test_plan_in_process_fsdp_tp_reports_everything():
    # Unrolled layers: XLA's cost analysis counts a while-loop body once, so only the
    # unrolled program's FLOPs can be compared with the formula (the scanned one below).
    cfg = load_config(CONFIG, ["mesh.strategy=fsdp_tp", "model.scan_layers=false"])
    plan = make_plan(cfg, build_mesh(cfg.mesh, jax.devices()), config_name="tiny")
    assert plan.num_devices == 8 and plan.mesh["fsdp"] == 4 and plan.mesh["tensor"] == 2
    ops = {c.op: c for c in plan.collectives}
    assert {"all-reduce", "all-gather"} <= set(ops)
    assert all(c.count > 0 and c.bytes > 0 for c in plan.collectives)
    # XLA's count and the PaLM formula agree to a few percent on this model.
    assert plan.flops_compiled == pytest.approx(plan.flops_analytic, rel=0.10)
    assert plan.fits
    text = plan.as_text()
    for needle in ("parameters", "optimizer state", "temporary", "peak", "all-gather", "fits"):
        assert needle in text
    scanned = make_plan(load_config(CONFIG, ["mesh.strategy=fsdp_tp"]), plan_mesh(cfg))
    assert scanned.param_bytes == plan.param_bytes and scanned.fits
    assert scanned.flops_compiled < 0.8 * plan.flops_compiled   # the loop body counted once
    assert "counts a loop body once" in scanned.as_text()
    assert plan.layer_stacks == []                      # unrolled: blocks/0/..., blocks/1/...
    stacks = {p["path"]: p for p in scanned.layer_stacks}
    assert stacks["blocks/mlp/up/kernel"]["logical_axes"] == ["layers", "embed", "mlp"]
    assert stacks["blocks/mlp/up/kernel"]["spec"] == [None, "fsdp", "tensor"]
    assert len(stacks) == 8 and all(p["shape"][0] == 2 for p in stacks.values())
    assert "8 parameters stacked along 'layers' (2 layers)" in scanned.as_text()
    assert scanned.as_json()["layer_stacks"] == scanned.layer_stacks


def pp_plan(*overrides: str):
    """The plan of the 4-layer transformer under `pp` with these overrides."""
    cfg = load_config(CONFIG, ["mesh.strategy=pp", "model.num_layers=4", *overrides])
    return make_plan(cfg, plan_mesh(cfg))


def test_plan_under_pp_reports_stages_bubble_and_stage_transfers():
    plan = pp_plan("mesh.axes.stage=4", "mesh.axes.data=2", "train.microbatches=2",
                   "train.pipeline_schedule=1f1b")
    p = plan.pipeline
    assert (p["stages"], p["microbatches"], p["schedule"]) == (4, 2, "1f1b")
    assert p["layers_per_stage"] == 1
    assert p["bubble_fraction"] == pytest.approx(3 / 5)                  # (S - 1) / (M + S - 1)
    # the stacked blocks are split over the 4 stages: a quarter of them per device
    assert p["stacked_bytes_unstaged_per_device"] == 4 * p["stacked_bytes_per_device"] > 0
    assert p["stage_transfers"] > 0 and p["stage_transfer_bytes"] > 0    # collective-permutes
    text = plan.as_text()
    assert "pipeline: 4 stages over stage, 1 layers per stage, 2 microbatches" in text
    assert "bubble fraction (S - 1) / (M + S - 1) = 0.600" in text
    assert plan.as_json()["pipeline"]["stage_transfers"] == p["stage_transfers"]


def test_plan_under_circular_pp_reports_repeats_and_their_bubble():
    plan = pp_plan("mesh.axes.stage=2", "mesh.axes.data=4", "train.microbatches=2",
                   "train.pipeline_repeats=2")
    p = plan.pipeline
    assert (p["stages"], p["microbatches"], p["repeats"]) == (2, 2, 2)
    assert p["bubble_fraction"] == pytest.approx(1 / 5)          # (S - 1) / (R M + S - 1)
    assert p["stacked_bytes_unstaged_per_device"] == 2 * p["stacked_bytes_per_device"] > 0
    text = plan.as_text()
    assert "schedule gpipe, 2 repeats (circular)" in text
    assert "bubble fraction (S - 1) / (R M + S - 1) = 0.200" in text


@pytest.mark.parametrize("devices,overrides", [
    (64, ["mesh.strategy=fsdp", "train.batch_size=64"]),
    (512, ["mesh.strategy=dp", "train.batch_size=512"]),
])
def test_plan_many_devices(devices, overrides):
    proc = run_spmd("plan", str(CONFIG), "--devices", str(devices), *overrides)
    assert proc.returncode == 0, proc.stderr
    assert f"({devices} devices;" in proc.stdout
    assert "fits" in proc.stdout and "all-reduce" in proc.stdout


@pytest.fixture(scope="module")
def plans_on_8():
    """The `spmd plan --devices 8` commands below (CPU backend) in one child process
    (tests/helpers/cli_batch.py) instead of one Python start each: name -> result."""
    big = ["model.d_model=8192", "model.d_ff=32768", "model.num_heads=64"]
    runs = {"summit": ("--system", "summit", "--json", *big), "nosuch": ("--system", "nosuch"),
            "text": ()}
    env = clean_env(SPMD_MPI="0")
    return dict(zip(runs, run_batch([(env, ["plan", str(CONFIG), "--devices", "8", *args])
                                     for args in runs.values()])))


def test_plan_that_does_not_fit_exits_nonzero_with_the_numbers(plans_on_8):
    proc = plans_on_8["summit"]
    assert proc.returncode == 3, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert not report["fits"] and report["available_bytes"] == int(16 * 2**30 * 0.9)
    assert report["over_bytes"] == report["peak_bytes"] - report["available_bytes"] > 0
    assert "does not fit summit" in proc.stderr and "over by" in proc.stderr
    assert "GiB available" in proc.stderr


def test_plan_unknown_system_is_a_user_error(plans_on_8):
    proc = plans_on_8["nosuch"]
    assert proc.returncode == 2
    assert "unknown system 'nosuch'" in proc.stderr and "Traceback" not in proc.stderr


HLO = "\n".join([
    "ENTRY %main {",
    "  %p = f32[1024]{0} parameter(0)",
    "  %all-reduce.1 = (f32[], f32[256,64]{1,0}) all-reduce(%a, %b), channel_id=1, "
    "replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0'}, to_apply=%add",
    "  %all-gather-start = (bf16[8]{0}, bf16[64]{0}) all-gather-start(%p), channel_id=2, "
    "replica_groups=[1,8]<=[8], dimensions={0}",
    "  %all-gather-done = bf16[64]{0} all-gather-done(%all-gather-start)",
    "  %reduce-scatter.3 = f32[16]{0} reduce-scatter(%p), replica_groups={{0,1},{2,3}}, "
    "dimensions={0}",
    "  %collective-permute.4 = s32[4,32]{1,0} collective-permute(%p), "
    "source_target_pairs={{0,1},{1,0}}",
    "  ROOT %all-to-all.5 = (f32[2,8]{1,0}, f32[2,8]{1,0}) all-to-all(%x, %y), replica_groups={}",
    "}",
])


def test_collectives_from_hlo_counts_and_sizes():
    ops = {c.op: c for c in collectives_from_hlo(HLO, num_devices=8)}
    assert ops["all-reduce"].count == 1 and ops["all-reduce"].bytes == 4 + 256 * 64 * 4
    assert ops["all-reduce"].group_sizes == [4]
    assert ops["all-gather"].count == 1 and ops["all-gather"].bytes == 128  # the -done result
    assert ops["all-gather"].group_sizes == [8]
    assert ops["all-gather"].traffic_bytes == 128 * 7 // 8
    assert ops["reduce-scatter"].bytes == 64 and ops["reduce-scatter"].group_sizes == [2]
    assert ops["collective-permute"].bytes == 4 * 32 * 4
    assert ops["all-to-all"].bytes == 2 * 64 and ops["all-to-all"].group_sizes == [8]


def test_plan_for_an_nvidia_system_falls_back_to_the_cpu_compiler_without_a_gpu(plans_on_8):
    """No GPU here: the GPU-topology path is skipped and the plan says the CPU compiled it."""
    env = clean_env()
    env.pop("JAX_PLATFORMS")          # let plan_devices look for a GPU itself
    proc = run_spmd("plan", str(CONFIG), "--devices", "8", "--system", "perlmutter-80g",
                    "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["compiler"] == "cpu" and report["num_devices"] == 8
    assert "CPU stand-in devices (no NVIDIA GPU visible here)" in report["compiler_note"]
    text = plans_on_8["text"].stdout
    assert "compiler: cpu (8 CPU stand-in devices (no NVIDIA --system profile))" in text
    assert "cpu compiler: activations, gradients, scratch" in text


def test_gpu_target_config_for_the_profiles_gpus():
    h100 = gpu_target_config("NVIDIA H100 80GB HBM3", 80 * 2**30)
    assert "core_count: 132" in h100 and "major: 9" in h100
    assert f"device_memory_size: {80 * 2**30}" in h100 and 'platform_name: "CUDA"' in h100
    assert "major: 8" in gpu_target_config("NVIDIA A100-SXM4-40GB", 40 * 2**30)
    assert gpu_target_config("NVIDIA V100-SXM2-16GB", 16 * 2**30) is None
    cfg = load_config(CONFIG, ["mesh.strategy=dp"])
    assert make_plan(cfg, build_mesh(cfg.mesh, jax.devices())).compiler == "cpu"
