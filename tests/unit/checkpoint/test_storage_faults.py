"""Bad storage (issue 23, faults 5c, 5e, 5f): a run.dir that is a file or cannot be written,
and a damaged HDF5 data file, are named in one line instead of a traceback; a rejected run
writes nothing in run.dir (nor creates it) and says so once; an intact Orbax step whose
manifest is truncated is kept (and named) rather than deleted; the persistent tier holds
exactly `checkpoint.keep` steps."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

import spmd
from spmd.checkpoint.listing import scan_persistent
from spmd.config.load import with_overrides
from spmd.errors import ConfigError
from tests.helpers.env import REPO, clean_env, require, run_spmd
from tests.helpers.records import read_jsonl
from tests.helpers.training import mlp_config

MLP = str(REPO / "configs" / "mlp_tiny.yaml")
QUIET = ("run.progress=false", "run.plots=false", "train.steps=4")


pytestmark = pytest.mark.usefixtures("keep_signal_handlers")


def one_line_error(result: subprocess.CompletedProcess) -> str:
    lines = [x for x in result.stderr.splitlines() if "error:" in x]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert len(lines) == 1, result.stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize("command", ["train", "run"])
def test_a_run_dir_that_is_a_file_is_named_in_one_line(tmp_path, command):
    not_a_dir = tmp_path / "results.txt"
    not_a_dir.write_text("a user's file\n")
    args = ("run", "-n", "1") if command == "run" else ("train",)
    r = run_spmd(*args, MLP, f"run.dir={not_a_dir}", *QUIET, cwd=REPO,
                 env=clean_env(JAX_NUM_CPU_DEVICES="1"))
    assert r.returncode == 2
    assert f"run.dir={not_a_dir} is a file, not a directory" in one_line_error(r)
    assert not_a_dir.read_text() == "a user's file\n"


def test_an_unwritable_run_dir_is_named_in_one_line(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    made = subprocess.run(["chattr", "+i", str(locked)], capture_output=True, text=True)
    require(made.returncode == 0, f"chattr +i on {tmp_path} ({made.stderr.strip()})")
    try:
        r = run_spmd("train", MLP, f"run.dir={locked / 'run'}", *QUIET, cwd=REPO,
                     env=clean_env(JAX_NUM_CPU_DEVICES="1"))
    finally:
        subprocess.run(["chattr", "-i", str(locked)], check=True)
    assert r.returncode == 2
    line = one_line_error(r)
    assert f"run.dir={locked / 'run'} cannot be written" in line, line


def snapshot(root: Path) -> dict[str, tuple[bytes | None, int]]:
    """Every path under `root`, and `root` itself: its bytes (None: a directory) and mtime."""
    return {str(path.relative_to(root)): (None if path.is_dir() else path.read_bytes(),
                                          path.stat().st_mtime_ns)
            for path in [root, *sorted(root.rglob("*"))]}


def test_a_rejected_run_leaves_an_existing_run_dir_as_it_was(run_dir):
    """Validated before anything is written (5c): config.yaml, lease.json, logs/,
    events.jsonl and the checkpoints keep their bytes and mtimes."""
    base = mlp_config(run_dir, steps=2)
    assert spmd.train(base) == 0
    before = snapshot(run_dir)
    assert {"config.yaml", "events.jsonl", "logs/rank00000.log"} <= set(before)
    with pytest.raises(ConfigError, match="mesh.axes"):
        spmd.train(with_overrides(base, ["mesh.axes.data=3", "train.steps=4"]))
    assert snapshot(run_dir) == before


def test_a_run_rejected_for_its_mesh_creates_no_run_dir_and_says_so_once(tmp_path):
    fresh = tmp_path / "fresh"
    r = run_spmd("train", MLP, f"run.dir={fresh}", "mesh.axes.data=3", *QUIET, cwd=REPO,
                 env=clean_env(JAX_NUM_CPU_DEVICES="2"))
    assert r.returncode == 2, r.stderr[-3000:]
    assert not fresh.exists()
    error = "mesh.axes: sizes (data=3) multiply to 3 but there are 2 devices"
    assert error in one_line_error(r)
    assert r.stderr.count(error) == 1, r.stderr[-3000:]   # not also as a log line


def test_a_truncated_manifest_keeps_its_step_and_names_it(run_dir):
    config = mlp_config(run_dir, steps=4, checkpoint={"persistent_every": 2, "keep": 3})
    assert spmd.train(config) == 0
    manifest = run_dir / "checkpoints" / "4" / "spmd_manifest.json"
    manifest.write_bytes(manifest.read_bytes()[:40])        # a torn write
    assert spmd.train(with_overrides(config, ["train.steps=4"])) == 0
    events = read_jsonl(run_dir / "events.jsonl")
    restored = [e for e in events if e["event"] == "restored"]
    assert restored[-1]["step"] == 2 and restored[-1]["source"] == "persistent"
    kept = [e for e in events if e["event"] == "checkpoint_kept"]
    assert [(e["step"], e["manifest"]) for e in kept] == [(4, str(manifest))]
    assert not any(e["event"] == "checkpoint_discarded" for e in events)
    # the rerun trains step 4 again and commits it afresh over the damaged one
    assert [e["step"] for e in events if e["event"] == "saved"][-1] == 4
    assert (run_dir / "checkpoints" / "4" / "spmd_manifest.json").stat().st_size > 40


def test_the_persistent_tier_keeps_exactly_keep_steps(run_dir):
    config = mlp_config(run_dir, steps=5, checkpoint={"persistent_every": 1, "keep": 2})
    assert spmd.train(config) == 0
    assert [s.step for s in scan_persistent(run_dir / "checkpoints")] == [4, 5]
    saved = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "saved"]
    assert [e["dropped"] for e in saved] == [[], [], [1], [2], [3]]


def test_a_damaged_hdf5_file_is_named_in_one_line(tmp_path):
    data = tmp_path / "darcy.h5"
    sizes = ("data.num_train=16", "data.num_test=16", "model.grid=16", "model.modes=4")
    made = run_spmd("data", "make", str(REPO / "configs" / "fno_darcy.yaml"),
                    f"data.path={data}", *sizes, cwd=REPO)
    assert made.returncode == 0, made.stderr[-3000:]
    size = data.stat().st_size
    with open(data, "r+b") as f:            # a copy that stopped half-way: zeroed tail
        f.seek(size // 2)
        f.write(b"\0" * (size - size // 2))
    r = run_spmd("data", "info", str(REPO / "configs" / "fno_darcy.yaml"),
                 f"data.path={data}", *sizes, cwd=REPO)
    assert r.returncode == 2
    line = one_line_error(r)
    assert f"data.path={data}: cannot read the HDF5 file" in line and "corrupt" in line
