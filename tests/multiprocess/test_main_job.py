"""The README's main command, run as a new user would, in a fresh clone of this repo."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers.env import REPO, clean_env, compile_sources

README = (REPO / "README.md").read_text()


def readme_main_command() -> list[str]:
    """The first command under 'Run the main job', split at its `&&`."""
    block = README.split("Run the main job", 1)[1]
    command = re.search(r"```bash\n(.+?)\n```", block, re.S).group(1).strip()
    return [part.strip() for part in command.split("&&")]


def readme_claim() -> tuple[float, float, int]:
    """(initial, final, steps) from the README's stated test error."""
    text = " ".join(README.split())
    m = re.search(r"test relative L2 error falls from ([\d.]+) at step 0 to ([\d.]+) "
                  r"after (\d+) steps", text)
    assert m, "README must state the measured test error of the main job"
    return float(m.group(1)), float(m.group(2)), int(m.group(3))


@dataclass(frozen=True)
class MainJob:
    clone: Path
    run_dir: Path
    env: dict
    stderr: str


@pytest.fixture(scope="module")
def main_job(tmp_path_factory) -> MainJob:
    """The README's main command, run once in a fresh clone (the install is the runner's)."""
    install, *rest = readme_main_command()
    assert install.startswith("pip install -e '.[local"), install  # done by the test runner
    clone = tmp_path_factory.mktemp("main_job") / "clone"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    compile_sources(clone)   # as the suite's own sources: each rank and CLI call imports them
    env = clean_env(fast_compile=False, PYTHONPATH=str(clone))  # 200 steps: runs, not compiles
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env["PATH"]
    for command in rest:
        r = subprocess.run(shlex.split(command), cwd=clone, env=env, capture_output=True,
                           text=True, timeout=900)
        assert r.returncode == 0, f"{command}\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    return MainJob(clone, clone / "runs" / "fno_darcy", env, r.stderr)


@pytest.mark.slow
def test_readme_main_command_in_a_fresh_clone(main_job):
    run_dir, r = main_job.run_dir, main_job
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    evals = [r for r in records if "test_rel_l2" in r]
    train = [r for r in records if "loss" in r]
    claimed_initial, claimed_final, steps = readme_claim()
    assert train[-1]["step"] == steps
    assert evals[0]["step"] == 0 and evals[-1]["step"] == steps
    initial, final = evals[0]["test_rel_l2"], evals[-1]["test_rel_l2"]
    assert final <= initial / 2, (initial, final)  # falls by at least half
    assert final <= claimed_final * 1.5, (final, claimed_final)
    assert abs(initial - claimed_initial) <= 0.25 * claimed_initial
    events = [json.loads(line) for line in (run_dir / "events.jsonl").open()]
    assert any(e["event"] == "saved" and e.get("tier") == "persistent" for e in events)
    for png in ("loss.png", "test_error.png", "throughput.png", "samples.png"):
        assert (run_dir / "plots" / png).stat().st_size > 5000, png
    assert "ETA" in r.stderr or "step " in r.stderr  # rank-0 progress


def orbax_snippet() -> str:
    """The plain-Orbax snippet of docs/using_a_trained_run.md, as a user would copy it."""
    text = (REPO / "docs" / "using_a_trained_run.md").read_text()
    block = text.split("## Reading a persistent checkpoint with plain Orbax", 1)[1]
    return re.search(r"```python\n(.+?)\n```", block, re.S).group(1)


JAX_ONLY = """
import sys, numpy as np
from jax import export
predict = export.deserialize(open(sys.argv[1], "rb").read())
x = np.load(sys.argv[2])
np.save(sys.argv[3], np.asarray(predict.call(x)))
assert not any(m == "spmd" or m.startswith("spmd.") for m in sys.modules), "spmd imported"
"""


def run_python(code: str, *args: str, cwd: Path, env: dict) -> None:
    r = subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-5000:]


@pytest.mark.slow
def test_the_trained_main_job_evaluates_predicts_exports_and_reads_with_plain_orbax(
        main_job, tmp_path):
    import h5py
    import jax
    import numpy as np

    import spmd

    clone, run_dir, env = main_job.clone, main_job.run_dir, main_job.env

    def spmd_cli(*args: str) -> subprocess.CompletedProcess:
        r = subprocess.run([sys.executable, "-m", "spmd.cli", *args], cwd=clone, env=env,
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, f"spmd {args}\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
        return r

    last = [json.loads(x) for x in (run_dir / "metrics.jsonl").open() if "test_rel_l2" in x][-1]
    # spmd eval: the last evaluation of the run, recomputed on one process
    report = json.loads(spmd_cli("eval", "runs/fno_darcy", "--json").stdout)
    assert report["step"] == last["step"] == 200
    assert report["metrics"]["test_rel_l2"] == pytest.approx(last["test_rel_l2"], rel=1e-5)
    # spmd predict over the test split: its relative L2 error is the evaluated one
    spmd_cli("predict", "runs/fno_darcy", "--input", "data/darcy_g64.h5", "--output",
             str(tmp_path / "pred.h5"))
    with h5py.File(tmp_path / "pred.h5") as f, h5py.File(clone / "data/darcy_g64.h5") as d:
        pred, truth = f["prediction"][:], d["test/u"][:].reshape(f["prediction"].shape)
        inputs = d["test/a"][:].reshape(truth.shape)
    axes = tuple(range(1, pred.ndim))
    rel = np.sqrt(((pred - truth) ** 2).sum(axes)) / np.sqrt((truth**2).sum(axes))
    assert rel.mean() == pytest.approx(last["test_rel_l2"], rel=1e-5)
    # spmd export: the StableHLO artifact runs where spmd is not even imported
    spmd_cli("export", "runs/fno_darcy", str(tmp_path / "exported"))
    for n in (3, 16):
        np.save(tmp_path / f"x{n}.npy", inputs[:n])
        run_python(JAX_ONLY, tmp_path / "exported" / "predict.jax", tmp_path / f"x{n}.npy",
                   tmp_path / f"y{n}.npy", cwd=tmp_path, env=env)
        got = np.load(tmp_path / f"y{n}.npy")
        np.testing.assert_allclose(got, pred[:n], rtol=1e-6, atol=1e-6 * np.abs(pred).max())
    # the trained parameters, three ways: spmd.load, Flax's NNX recipe, plain Orbax (docs)
    trained = spmd.load(run_dir, overrides=[f"data.path={clone / 'data/darcy_g64.h5'}"])
    loaded = [np.asarray(x) for x in jax.tree.leaves(trained.params)]
    flax_recipe = f"""
import sys, numpy as np, jax, orbax.checkpoint as ocp
from flax import nnx
from spmd.models.fno import FNO2d
abstract = nnx.eval_shape(lambda: FNO2d(in_channels=1, out_channels=1, width=32, modes=12,
                                        num_layers=4, projection=128, rngs=nnx.Rngs(0)))
graphdef, abstract_state = nnx.split(abstract)
with ocp.StandardCheckpointer() as checkpointer:
    state = checkpointer.restore("{tmp_path / 'exported' / 'params'}", abstract_state)
model = nnx.merge(graphdef, state)
params = nnx.to_pure_dict(nnx.state(model))
"""
    dump = "\nnp.savez(sys.argv[1], *[np.asarray(x) for x in jax.tree.leaves(params)])\n"
    snippet = orbax_snippet().replace("runs/fno_darcy/checkpoints/200",
                                      str(run_dir / "checkpoints" / "200"))
    for name, code in (("flax", flax_recipe), ("orbax", "import sys, numpy as np\n" + snippet)):
        out = tmp_path / f"{name}.npz"
        run_python(code + dump, out, cwd=tmp_path, env=env)
        with np.load(out) as z:
            got = [z[f"arr_{i}"] for i in range(len(z.files))]
        assert len(got) == len(loaded), name
        assert all(a.tobytes() == b.tobytes() for a, b in zip(got, loaded)), name


@pytest.mark.slow
def test_every_runnable_doc_snippet_runs_verbatim_after_the_main_job(main_job):
    """Issue 36: each ```python snippet of README.md and docs/ that is not marked `# not run`
    runs as written (tests/helpers/doc_snippets.py), page by page in order, in the main job's
    directory, after the README's `spmd export runs/fno_darcy exported/`."""
    from tests.helpers.doc_snippets import all_snippets, pages_script

    clone, env = main_job.clone, main_job.env
    r = subprocess.run([sys.executable, "-m", "spmd.cli", "export", "runs/fno_darcy",
                        "exported/"], cwd=clone, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-5000:]
    program, pages = pages_script()
    r = subprocess.run([sys.executable, "-c", program, pages], cwd=clone, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    ran = [line.split()[1] for line in r.stdout.splitlines() if line.startswith("ran ")]
    assert ran == [s.where for s in all_snippets() if s.runnable]
