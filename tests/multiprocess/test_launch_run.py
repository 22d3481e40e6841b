"""`spmd run`: N local ranks through mpiexec, node grouping, signal forwarding, exit status."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.env import REPO, clean_env, mpiexec_path, require, run_spmd

pytestmark = pytest.mark.slow
MLP = str(REPO / "configs" / "mlp_tiny.yaml")


def need_mpiexec() -> None:
    mpiexec_path()


def doctor_reports(stdout: str) -> list[dict]:
    return sorted((json.loads(line) for line in stdout.splitlines() if line.startswith("{")),
                  key=lambda r: r["rank"])


@pytest.mark.parametrize("ppn,nodes", [(1, [0, 1, 2, 3]), (2, [0, 0, 1, 1])])
def test_run_groups_ranks_into_nodes(ppn, nodes):
    need_mpiexec()
    result = run_spmd("run", "-n", "4", "--ppn", str(ppn), "--entry", "doctor", MLP, "--",
                      "--json", timeout=120)
    assert result.returncode == 0, result.stderr
    reports = doctor_reports(result.stdout)
    assert [r["rank"] for r in reports] == [0, 1, 2, 3]
    assert all(r["node_of_rank"] == nodes for r in reports)
    assert [r["node_id"] for r in reports] == nodes
    assert [r["local_rank"] for r in reports] == [0, 1, 2, 3]  # one physical host
    assert {r["sources"]["node_id"] for r in reports} == {f"SPMD_PROCESSES_PER_NODE={ppn}"}
    assert len({r["coordinator"] for r in reports}) == 1
    # the ranks' malloc asks for transparent huge pages (spmd.launch.huge_pages)
    assert {r["malloc"]["glibc_tunables"] for r in reports} == {"glibc.malloc.hugetlb=1"}


def test_run_ignores_an_outer_launchers_rank_variables():
    need_mpiexec()
    env = clean_env(SLURM_PROCID="0", SLURM_NTASKS="1", SLURM_LOCALID="0", PMI_RANK="0",
                    PMI_SIZE="1", SPMD_RANK="0", SPMD_SIZE="1",
                    GLIBC_TUNABLES="glibc.malloc.arena_max=4")
    result = run_spmd("run", "-n", "2", "--entry", "doctor", MLP, "--", "--json", env=env,
                      timeout=120)
    assert result.returncode == 0, result.stderr
    reports = doctor_reports(result.stdout)
    assert [(r["rank"], r["size"]) for r in reports] == [(0, 2), (1, 2)]
    # a tunable of the user's is kept, huge pages added
    assert {r["malloc"]["glibc_tunables"] for r in reports} == {
        "glibc.malloc.arena_max=4:glibc.malloc.hugetlb=1"}


def test_run_without_mpiexec_says_how_to_install(tmp_path):
    # A python whose directory holds no mpiexec, with PATH holding none either. The symlinked
    # base interpreter loses a virtualenv's site-packages, so they are added with
    # site.addsitedir, which (unlike PYTHONPATH) also runs their .pth files: an editable
    # install's import finder (spmd.launch -> launch/) lives in one. This works for a venv,
    # a system Python, an editable install and a plain one alike. `-S`: the base
    # interpreter's own site-packages stay out, so an editable install of another checkout
    # there (its finder module has the same name) cannot shadow this one's.
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "python").symlink_to(os.path.realpath(sys.executable))
    site_dirs = [p for p in sys.path if p.endswith("-packages")]
    start = ("import runpy, site, sys\n"
             f"for d in {site_dirs!r}: site.addsitedir(d)\n"
             "sys.argv = ['spmd', *sys.argv[1:]]\n"
             "runpy.run_module('spmd.cli', run_name='__main__')\n")
    env = clean_env(PATH=str(bindir))
    env.pop("PYTHONPATH", None)
    result = subprocess.run([str(bindir / "python"), "-S", "-c", start, "run", "-n", "2", MLP],
                            capture_output=True, text=True, env=env, timeout=60, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert "pip install 'spmd-hpc[local]'" in result.stderr


def rank_pids(run_dir: Path) -> dict[int, int]:
    """{rank: pid} of the `spmd train` ranks whose command line names `run_dir`."""
    pids = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if (b"train" in cmdline and f"run.dir={run_dir}".encode() in cmdline
                and not any(arg.endswith(b"rank_shim.py") for arg in cmdline)):
            for var in environ:
                if var.startswith(b"PMI_RANK="):
                    pids[int(var.split(b"=")[1])] = int(proc.name)
    return pids


def start_long_run(run_dir: Path) -> subprocess.Popen:
    need_mpiexec()
    require(run_spmd("train", "--help").returncode == 0, "`spmd train` (the lead's trainer)")
    env = clean_env(JAX_NUM_CPU_DEVICES="2")
    proc = subprocess.Popen(
        [sys.executable, "-m", "spmd.cli", "run", "-n", "2", MLP, f"run.dir={run_dir}",
         "train.steps=100000", "run.progress=false"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
    deadline = time.monotonic() + 180
    metrics = run_dir / "metrics.jsonl"
    while not (metrics.exists() and metrics.read_text().strip()):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"no metrics from the run:\n{proc.communicate()[0]}")
        time.sleep(0.2)
    return proc


def assert_preempted_together(proc: subprocess.Popen, run_dir: Path, who: str) -> None:
    output = proc.communicate(timeout=120)[0]
    assert proc.returncode == 75, output
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    stops = {e["rank"]: e for e in events if e["event"] == "preempted"}
    assert set(stops) == {0, 1}, events
    assert stops[0]["step"] == stops[1]["step"]
    assert who in stops[0]["reason"] and stops[0]["reason"] == stops[1]["reason"]


def test_signal_to_one_rank_preempts_all(tmp_path):
    run_dir = tmp_path / "run"
    proc = start_long_run(run_dir)
    pids = rank_pids(run_dir)
    assert set(pids) == {0, 1}, pids
    os.kill(pids[1], signal.SIGUSR1)
    assert_preempted_together(proc, run_dir, "SIGUSR1 received by rank 1")


def test_sigterm_to_spmd_run_is_forwarded(tmp_path):
    run_dir = tmp_path / "run"
    proc = start_long_run(run_dir)
    proc.send_signal(signal.SIGTERM)
    assert_preempted_together(proc, run_dir, "SIGTERM received by rank")
