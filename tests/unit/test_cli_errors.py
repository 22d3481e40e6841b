"""Bad input: a non-zero exit, a message that names what to fix, and no traceback."""

from __future__ import annotations

import json

import pytest

from tests.helpers.env import REPO, clean_env, run_spmd

TINY = str(REPO / "configs" / "transformer_tiny.yaml")
EIGHT = clean_env(JAX_NUM_CPU_DEVICES="8")


def assert_clean_failure(result, *needles: str) -> None:
    assert result.returncode != 0, result.stdout
    assert "Traceback" not in result.stderr, result.stderr
    for needle in needles:
        assert needle in result.stderr, f"{needle!r} not in:\n{result.stderr}"


@pytest.mark.parametrize("command", ["train", "shardings"])
def test_mesh_axes_that_do_not_fit_the_devices(command, run_dir):
    r = run_spmd(command, TINY, "mesh.axes.tensor=3", f"run.dir={run_dir}", env=EIGHT)
    assert_clean_failure(r, "mesh.axes", "tensor=3", "8 devices")


@pytest.mark.parametrize("command", ["train", "shardings"])
def test_rule_pointing_at_missing_mesh_axis(command, run_dir):
    r = run_spmd(command, TINY, "mesh.rules.mlp=tensr", f"run.dir={run_dir}", env=EIGHT)
    assert_clean_failure(r, "mesh.rules.mlp", "'tensr'", "does not exist")


@pytest.mark.parametrize("command", ["train", "shardings"])
def test_d_model_not_divisible_by_tensor_axis_names_parameter(command, run_dir):
    # Megatron-style sequence of rules that puts embed on tensor (heads etc. replicated).
    r = run_spmd(command, TINY, "mesh.strategy=tp", "mesh.rules.embed=tensor",
                 "mesh.rules.mlp=null", "mesh.rules.heads=null", "mesh.rules.vocab=null",
                 "model.d_model=36", "model.num_heads=4", f"run.dir={run_dir}", env=EIGHT)
    assert_clean_failure(r, "parameter ", "('embed') has size 36", "tensor=8")
    assert "blocks/" in r.stderr or "embedding" in r.stderr


@pytest.mark.parametrize("command", ["train", "shardings"])
def test_unknown_key_names_closest(command, run_dir):
    r = run_spmd(command, TINY, "train.step=5", f"run.dir={run_dir}", env=EIGHT)
    assert_clean_failure(r, "unknown config key 'train.step'", "did you mean 'train.steps'")


def test_unknown_key_in_file_names_closest(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model:\n  name: transformer\n  d_modle: 64\n")
    assert_clean_failure(run_spmd("train", str(cfg), env=EIGHT), "model.d_modle",
                         "did you mean 'model.d_model'")


def test_yaml_that_does_not_parse(tmp_path):
    cfg = tmp_path / "broken.yaml"
    cfg.write_text("model:\n  name: [transformer\n  d_model: 64\n")
    assert_clean_failure(run_spmd("train", str(cfg), env=EIGHT), str(cfg), "does not parse")


def test_debug_flag_keeps_the_traceback(tmp_path):
    r = run_spmd("--debug", "shardings", TINY, "mesh.axes.tensor=3", env=EIGHT)
    assert r.returncode != 0 and "Traceback" in r.stderr


def test_shardings_json_report():
    r = run_spmd("shardings", TINY, "mesh.strategy=fsdp_tp", "--json", env=EIGHT)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["mesh"]["fsdp"] == 4 and report["mesh"]["tensor"] == 2
    up = next(p for p in report["params"] if p["path"] == "blocks/mlp/up/kernel")  # stacked
    assert up["logical_axes"] == ["layers", "embed", "mlp"]
    assert up["spec"] == [None, "fsdp", "tensor"]
    assert up["bytes_per_device"] == 2 * 64 * 256 * 4 // 8
    assert report["replicated_fraction"] < 0.01


def test_replicated_fraction_check_fails_a_replicating_config():
    r = run_spmd("shardings", TINY, "mesh.strategy=dp", "mesh.max_replicated_fraction=0.1",
                 env=EIGHT)
    assert_clean_failure(r, "replicated fraction 1.000", "mesh.max_replicated_fraction=0.1")
    ok = run_spmd("shardings", TINY, "mesh.strategy=fsdp", "mesh.max_replicated_fraction=0.1",
                  env=EIGHT)
    assert ok.returncode == 0, ok.stderr
