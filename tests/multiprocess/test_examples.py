"""The user examples in examples/ run as a user runs them: `spmd run -n 2 CONFIG` from the
repository root, 2 ranks x 4 (unet3d, dp and spatial) and 2 ranks x 1 (vit2d) CPU devices.
Each learns (its test relative L2 error at least halves from the step-0 evaluation to the
last), plots its sample fields, and resumes from its last checkpoint; `spmd shardings`
and `spmd plan` accept both.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.env import REPO, clean_env, mpiexec_path, run_spmd

EXAMPLES = {"unet3d": 20, "vit2d": 80}      # example -> train.steps of its config
QUIET = ("run.progress=false",)


def records(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]


def events(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines() if x]


def spmd_run(name: str, devices: int, run_dir: Path, data: Path, *overrides: str):
    mpiexec_path()
    return run_spmd("run", "-n", "2", f"examples/{name}/config.yaml", f"run.dir={run_dir}",
                    f"data.path={data}", *QUIET, *overrides, timeout=600, cwd=REPO,
                    env=clean_env(JAX_NUM_CPU_DEVICES=str(devices)))


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("example_data")


@pytest.fixture(scope="module")
def trained(data_dir, tmp_path_factory):
    """(example, devices, overrides) -> run dir of a finished run, trained once each.

    As a user would over two allocations: the first run stops at half the config's steps
    (saving there), the second run of the same command resumes and finishes."""
    done: dict[tuple, Path] = {}

    def get(name: str, devices: int, *overrides: str) -> Path:
        key = (name, devices, overrides)
        if key not in done:
            run_dir = tmp_path_factory.mktemp(f"{name}_{devices}") / "run"
            data = data_dir / f"{name}.h5"
            half = EXAMPLES[name] // 2
            for extra in ((f"train.steps={half}",), ()):
                r = spmd_run(name, devices, run_dir, data, *overrides, *extra)
                assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
            done[key] = run_dir
        return done[key]

    return get


# Both device counts, both examples and both strategies, without every product (each case
# is two runs). That spatial slab reads build the batches of dp is tested on the feed
# itself (tests/multiprocess/test_data_arrays.py, test_multi_file_mp.py).
CASES = [("vit2d", 1, ()),
         ("unet3d", 4, ("mesh.strategy=spatial", "mesh.axes.context=4", "mesh.axes.tensor=2"))]
IDS = ["vit2d-2x1", "unet3d-spatial-2x4"]


@pytest.mark.slow
@pytest.mark.parametrize("name, devices, overrides", CASES, ids=IDS)
def test_example_learns_plots_and_resumes(trained, name, devices, overrides):
    run_dir = trained(name, devices, *overrides)
    steps, half = EXAMPLES[name], EXAMPLES[name] // 2
    evals = [r for r in records(run_dir) if "test_rel_l2" in r]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == steps
    first, last = evals[0]["test_rel_l2"], evals[-1]["test_rel_l2"]
    assert last <= 0.5 * first, (first, last)
    for png in ("samples.png", "loss.png", "test_error.png"):
        path = run_dir / "plots" / png
        assert path.is_file() and path.stat().st_size > 10_000, path
    started = [e for e in events(run_dir) if e["event"] == "started"]
    assert sorted(e["rank"] for e in started) == [0, 0, 1, 1]  # two runs of two ranks
    restored = [e for e in events(run_dir) if e["event"] == "restored"]
    assert sorted(e["rank"] for e in restored) == [0, 1]
    assert all(e["step"] == half for e in restored), restored
    logged = sorted({r["step"] for r in records(run_dir) if "loss" in r})
    assert logged[-1] == steps and half in logged


@pytest.mark.slow
def test_the_trained_surrogate_rolls_out_and_evaluates_on_every_rank(trained, data_dir,
                                                                     tmp_path):
    """`spmd predict --rollout 5` and `spmd eval` on the 2 x 4 spatial run, as jobs of 2
    ranks (`spmd run --entry`): the fields stay split by the run's spatial rules."""
    import h5py
    import numpy as np

    spatial = CASES[-1][2]
    run_dir, data = trained("unet3d", 4, *spatial), data_dir / "unet3d.h5"
    env = clean_env(JAX_NUM_CPU_DEVICES="4")

    def job(entry: str, *args: str):
        r = run_spmd("run", "-n", "2", "--entry", entry, str(run_dir), "--", *args,
                     timeout=600, cwd=REPO, env=env)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
        return r

    job("predict", "--input", str(data), "--output", str(tmp_path / "rollout.h5"),
        "--rollout", "5")
    one = run_spmd("predict", str(run_dir), "--input", str(data), "--output",
                   str(tmp_path / "one.h5"), cwd=REPO, env=clean_env(JAX_NUM_CPU_DEVICES="8"))
    assert one.returncode == 0, one.stderr[-5000:]
    with h5py.File(tmp_path / "rollout.h5") as f, h5py.File(tmp_path / "one.h5") as g:
        rollout, plain = f["prediction"][:], g["prediction"][:]
        assert f["prediction"].attrs["rollout"] == 5
    assert rollout.shape == (16, 5, 16, 16, 16, 1) and plain.shape == (16, 16, 16, 16, 1)
    np.testing.assert_allclose(rollout[:, 0], plain, rtol=1e-5, atol=1e-6)
    assert np.isfinite(rollout).all()
    assert all(np.abs(rollout[:, k + 1] - rollout[:, k]).max() > 0 for k in range(4))
    report = [json.loads(line) for line in job("eval", "--json").stdout.splitlines()
              if line.startswith("{")]
    assert len(report) == 1  # rank 0 reports
    last = [r for r in records(run_dir) if "test_rel_l2" in r][-1]
    assert report[0]["step"] == last["step"] == EXAMPLES["unet3d"]
    assert report[0]["metrics"]["test_rel_l2"] == pytest.approx(last["test_rel_l2"], rel=1e-5)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_shardings_and_plan_accept_the_example(name, tmp_path):
    """Without the data file: neither command reads data."""
    config = f"examples/{name}/config.yaml"
    missing = f"data.path={tmp_path / 'absent.h5'}"
    r = run_spmd("shardings", config, missing, "mesh.strategy=fsdp", "--json", cwd=REPO,
                 env=clean_env(JAX_NUM_CPU_DEVICES="8"))
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    axes = {p["path"]: p["logical_axes"] for p in report["params"]}
    assert any(a and "embed" in a for a in axes.values()), axes
    extra = (["mesh.strategy=spatial", "mesh.axes.context=4", "mesh.axes.tensor=2"]
             if name == "unet3d" else ["mesh.strategy=fsdp_tp"])
    r = run_spmd("plan", config, "--devices", "8", missing, *extra, "--json", cwd=REPO,
                 env=clean_env(JAX_NUM_CPU_DEVICES="1"))
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["param_bytes"] > 0 and plan["temp_bytes"] > 0
    assert not (tmp_path / "absent.h5").exists()


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_spmd_data_make_writes_the_field_task_dataset(name, tmp_path):
    """A FieldTask's `make_pairs` become {split}/{input,target} datasets via `spmd data make`."""
    import h5py

    config = f"examples/{name}/config.yaml"
    data = tmp_path / "fields.h5"
    made = run_spmd("data", "make", config, f"data.path={data}", cwd=REPO)
    assert made.returncode == 0, made.stderr
    assert f"wrote {data}" in made.stdout
    again = run_spmd("data", "make", config, f"data.path={data}", cwd=REPO)
    assert again.returncode == 0 and "exists" in again.stdout, again.stderr
    example = {"unet3d": (16, 16, 16, 1), "vit2d": (32, 32, 1)}[name]
    counts = {"unet3d": (256, 16), "vit2d": (512, 64)}[name]
    with h5py.File(data) as f:
        assert len(f["train"]) == len(f["test"]) == 2  # one input and one target field
        for split, count in zip(("train", "test"), counts):
            assert {f[split][n].shape for n in f[split]} == {(count, *example)}
    info = run_spmd("data", "info", config, f"data.path={data}", cwd=REPO)
    assert info.returncode == 0 and "train examples" in info.stdout, info.stderr
    assert "train order: blocks of" in info.stdout, info.stdout
