"""Bad input: a non-zero exit, a message that names what to fix, and no traceback.

Every command here runs in one child process (tests/helpers/cli_batch.py: one `spmd ...` after
another, each with its own captured stdout and stderr) instead of one Python start each: the
commands fail on their config, or report shardings, in well under the time a start takes.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from tests.helpers.cli_batch import run_batch
from tests.helpers.env import REPO, clean_env

TINY = str(REPO / "configs" / "transformer_tiny.yaml")
EIGHT = clean_env(JAX_NUM_CPU_DEVICES="8", SPMD_MPI="0")
COMMANDS = ["train", "shardings"]

# name -> spmd arguments after the command (train and shardings) ...
BOTH = {
    "axes": ("mesh.axes.tensor=3",),
    "rule": ("mesh.rules.mlp=tensr",),
    # Megatron-style sequence of rules that puts embed on tensor (heads etc. replicated).
    "d_model": ("mesh.strategy=tp", "mesh.rules.embed=tensor", "mesh.rules.mlp=null",
                "mesh.rules.heads=null", "mesh.rules.vocab=null", "model.d_model=36",
                "model.num_heads=4"),
    "unknown_key": ("train.step=5",),
}
# ... and name -> whole argument lists ({tmp}: this module's temporary directory)
SINGLE = {
    "unknown_key_in_file": ("train", "{tmp}/c.yaml"),
    "yaml": ("train", "{tmp}/broken.yaml"),
    "debug": ("--debug", "shardings", TINY, "mesh.axes.tensor=3"),
    "json": ("shardings", TINY, "mesh.strategy=fsdp_tp", "--json"),
    "replicating": ("shardings", TINY, "mesh.strategy=dp", "mesh.max_replicated_fraction=0.1"),
    "sharded": ("shardings", TINY, "mesh.strategy=fsdp", "mesh.max_replicated_fraction=0.1"),
}


@pytest.fixture(scope="module")
def cli(tmp_path_factory) -> dict[str, SimpleNamespace]:
    """Every command's result (returncode, stdout, stderr), from one child process."""
    tmp = tmp_path_factory.mktemp("cli_errors")
    (tmp / "c.yaml").write_text("model:\n  name: transformer\n  d_modle: 64\n")
    (tmp / "broken.yaml").write_text("model:\n  name: [transformer\n  d_model: 64\n")
    runs = {f"{name}-{command}": [command, TINY, *args, f"run.dir={tmp / name / command}"]
            for name, args in BOTH.items() for command in COMMANDS}
    runs.update({name: [a.format(tmp=tmp) for a in args] for name, args in SINGLE.items()})
    results = run_batch([(EIGHT, args) for args in runs.values()])
    return {"tmp": tmp, **dict(zip(runs, results))}


def assert_clean_failure(result, *needles: str) -> None:
    assert result.returncode != 0, result.stdout
    assert "Traceback" not in result.stderr, result.stderr
    for needle in needles:
        assert needle in result.stderr, f"{needle!r} not in:\n{result.stderr}"


@pytest.mark.parametrize("command", COMMANDS)
def test_mesh_axes_that_do_not_fit_the_devices(command, cli):
    assert_clean_failure(cli[f"axes-{command}"], "mesh.axes", "tensor=3", "8 devices")


@pytest.mark.parametrize("command", COMMANDS)
def test_rule_pointing_at_missing_mesh_axis(command, cli):
    assert_clean_failure(cli[f"rule-{command}"], "mesh.rules.mlp", "'tensr'", "does not exist")


@pytest.mark.parametrize("command", COMMANDS)
def test_d_model_not_divisible_by_tensor_axis_names_parameter(command, cli):
    r = cli[f"d_model-{command}"]
    assert_clean_failure(r, "parameter ", "('embed') has size 36", "tensor=8")
    assert "blocks/" in r.stderr or "embedding" in r.stderr


@pytest.mark.parametrize("command", COMMANDS)
def test_unknown_key_names_closest(command, cli):
    assert_clean_failure(cli[f"unknown_key-{command}"], "unknown config key 'train.step'",
                         "did you mean 'train.steps'")


def test_unknown_key_in_file_names_closest(cli):
    assert_clean_failure(cli["unknown_key_in_file"], "model.d_modle",
                         "did you mean 'model.d_model'")


def test_yaml_that_does_not_parse(cli):
    assert_clean_failure(cli["yaml"], str(cli["tmp"] / "broken.yaml"), "does not parse")


def test_debug_flag_keeps_the_traceback(cli):
    r = cli["debug"]
    assert r.returncode != 0 and "Traceback" in r.stderr


def test_shardings_json_report(cli):
    r = cli["json"]
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["mesh"]["fsdp"] == 4 and report["mesh"]["tensor"] == 2
    up = next(p for p in report["params"] if p["path"] == "blocks/mlp/up/kernel")  # stacked
    assert up["logical_axes"] == ["layers", "embed", "mlp"]
    assert up["spec"] == [None, "fsdp", "tensor"]
    assert up["bytes_per_device"] == 2 * 64 * 256 * 4 // 8
    assert report["replicated_fraction"] < 0.01


def test_replicated_fraction_check_fails_a_replicating_config(cli):
    assert_clean_failure(cli["replicating"], "replicated fraction 1.000",
                         "mesh.max_replicated_fraction=0.1")
    ok = cli["sharded"]
    assert ok.returncode == 0, ok.stderr
