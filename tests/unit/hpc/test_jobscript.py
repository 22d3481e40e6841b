"""`spmd jobscript`: rendered directives per system, bad input, the checks for the job's world
(mesh, batch, pipeline, memory: before anything is written or submitted), --setup, and the
script's bash logic.

The trap / forward / requeue logic of every scheduler's template runs here for real under bash,
with stub launchers (srun, jsrun, mpiexec, flux) that exec a fake rank, and stub requeue
commands (scontrol, brequeue, qrerun, qsub) that log their arguments. Real Slurm: see
tests/slurm/test_slurm_jobscript.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spmd.cli import main
from spmd.errors import ExitCode
from spmd.hpc.batch_scripts import (
    HALT_FILE_NAME,
    format_walltime,
    make_request,
    parse_walltime,
    render,
    write_script,
)
from spmd.hpc.job_submit import parse_job_id, submit_argv
from spmd.hpc.systems import GPU_XLA_FLAGS, SYSTEMS, system_profile
from tests.helpers.env import REPO, run_spmd

CONFIG = REPO / "configs" / "mlp_tiny.yaml"


def directives(text: str, prefix: str) -> list[str]:
    return [line[len(prefix):].strip() for line in text.splitlines() if line.startswith(prefix)]


def launcher_line(text: str, word: str) -> str:
    for line in text.splitlines():
        if line.startswith(word + " "):
            return line
    raise AssertionError(f"no line starting with {word!r} in:\n{text}")


def render_cli(capsys, *args: str) -> str:
    """Rendering only: the checks for the job's world need its device count (tests below)."""
    assert main(["jobscript", str(CONFIG), "--check", "none", *args]) == 0
    return capsys.readouterr().out


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    monkeypatch.chdir(REPO)


# ---------------------------------------------------------------- rendering per system


def test_summit_lsf_jsrun(capsys):
    text = render_cli(capsys, "--system", "summit", "--nodes", "4", "--time", "1:30",
                      "--account", "CSC123", "train.steps=3")
    d = directives(text, "#BSUB")
    for want in ("-nnodes 4", "-W 1:30", "-P CSC123", '-alloc_flags "gpumps smt1"', "-wa USR1",
                 "-wt 5", "-J spmd-mlp_tiny"):
        assert want in d, (want, d)
    assert any(x.startswith("-o ") and "runs/mlp_tiny/lsf-%J.out" in x for x in d)
    words = launcher_line(text, "jsrun").split()
    for want in ("-n24", "-r6", "-a1", "-c7", "-g1"):
        assert want in words, (want, words)
    assert 'brequeue "$SPMD_JOB_ID"' in text
    assert "trap 'spmd_trap USR1 requeue' USR1" in text


def test_polaris_pbs_mpiexec_and_binding(capsys):
    text = render_cli(capsys, "--system", "polaris", "--nodes", "4", "--time", "01:00:00",
                      "-A", "myproj")
    d = directives(text, "#PBS")
    for want in ("-l select=4:system=polaris", "-l place=scatter", "-l walltime=01:00:00",
                 "-l filesystems=home:eagle", "-A myproj", "-q prod", "-r y"):
        assert want in d, (want, d)
    line = launcher_line(text, "mpiexec")
    assert "-n 16 -ppn 4 --depth=8 --cpu-bind depth" in line
    assert '"$SPMD_BIND"' in line
    assert "PALS_LOCAL_RANKID" in text and "PMI_LOCAL_RANK" in text
    assert "export CUDA_VISIBLE_DEVICES=$(( 4 - 1 - local_rank % 4 ))" in text
    assert "trap 'spmd_trap TERM requeue' TERM" in text  # qdel / preemption
    assert "sleep 3300 &" in text  # walltime watchdog: 3600 s - 300 s warning
    assert 'qrerun "$SPMD_JOB_ID"' in text


def test_frontier_srun_binding(capsys):
    text = render_cli(capsys, "--system", "frontier", "--nodes", "4", "--time", "120",
                      "-A", "abc123")
    d = directives(text, "#SBATCH")
    for want in ("--nodes=4", "--time=02:00:00", "--account=abc123", "--signal=B:USR1@300",
                 "--requeue", "--open-mode=append", "--ntasks-per-node=8"):
        assert want in d, (want, d)
    words = launcher_line(text, "srun").split()
    for want in ("-n32", "-c7", "--gpus-per-task=1", "--gpu-bind=closest"):
        assert want in words, (want, words)
    assert 'scontrol requeue "$SPMD_JOB_ID"' in text
    assert "export GPU_MAX_HW_QUEUES=2" in text
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in text


def test_perlmutter_constraint_and_gpus(capsys):
    text = render_cli(capsys, "--system", "perlmutter", "--nodes", "2", "--time", "30",
                      "-A", "m1234")
    d = directives(text, "#SBATCH")
    for want in ("-C gpu", "--gpus-per-node=4", "--ntasks-per-node=4", "--qos=regular",
                 "--account=m1234", "--time=00:30:00"):
        assert want in d, (want, d)
    words = launcher_line(text, "srun").split()
    assert "-n8" in words and "--ntasks-per-node=4" in words and "--gpus-per-node=4" in words
    assert "export CUDA_DEVICE_MAX_CONNECTIONS=1" in text
    assert "export XLA_PYTHON_CLIENT_MEM_FRACTION=0.90" in text


def test_flux_batch(capsys):
    text = render_cli(capsys, "--system", "flux", "--nodes", "3", "--time", "1:30",
                      "--queue", "pbatch", "--account", "guests")
    d = directives(text, "#flux:")
    for want in ("-N 3", "-t 90m", "--signal=SIGUSR1@300s", "--queue=pbatch", "--bank=guests"):
        assert want in d, (want, d)
    assert any("--output=" in x and "flux-{{id}}.out" in x for x in d)
    assert launcher_line(text, "flux run").split()[2:5] == ["-N3", "-n12", "-g1"]
    assert 'flux --parent batch "$SPMD_SCRIPT"' in text


def test_generic_slurm_ranks_env_and_overrides(capsys):
    text = render_cli(capsys, "--system", "slurm", "--nodes", "1", "--time", "5",
                      "--ranks-per-node", "2", "--env", "JAX_NUM_CPU_DEVICES=2",
                      "train.steps=3", "--job-name", "tiny")
    d = directives(text, "#SBATCH")
    for want in ("--nodes=1", "--ntasks-per-node=2", "--time=00:05:00", "--job-name=tiny",
                 "--signal=B:USR1@30"):
        assert want in d, (want, d)
    line = launcher_line(text, "srun")
    assert "--mpi=pmi2" in line and "--ntasks=2" in line
    assert "export JAX_NUM_CPU_DEVICES=2" in text
    assert "XLA_FLAGS" not in text  # no GPU flags for a CPU profile
    train = next(x for x in text.splitlines() if "-m spmd.cli train" in x).split()
    assert train[0] == shlex.quote(sys.executable)
    assert train[4] == str(CONFIG) and "train.steps=3" in train
    # a 5 min job: the trainer's 300 s wall-time margin would stop it at once
    assert "launch.walltime_margin_s=30" in train


def test_generic_slurm_gpus(capsys):
    text = render_cli(capsys, "--system", "slurm", "--nodes", "2", "--time", "10",
                      "--gpus-per-node", "4")
    assert "--gpus-per-node=4" in directives(text, "#SBATCH")
    assert "--ntasks=8" in launcher_line(text, "srun")


@pytest.mark.parametrize("system", sorted(SYSTEMS))
def test_every_script_is_valid_bash_and_complete(system, capsys, tmp_path):
    text = render_cli(capsys, "--system", system, "--nodes", "2", "--time", "0:45",
                      "--account", "acct", "train.steps=3")
    path = tmp_path / "job.sh"
    path.write_text(text)
    r = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert text.startswith("#!/bin/bash\n")
    assert f"SPMD_PREEMPTED={int(ExitCode.PREEMPTED)}" in text
    assert "spmd_forward" in text and "kill -s USR2" in text
    assert 'wait "$spmd_step_pid"' in text
    assert "exit 0" in text  # after a successful requeue
    assert f'SPMD_HALT_FILE="$SPMD_RUN_DIR/{HALT_FILE_NAME}"' in text
    for var, value in SYSTEMS[system].env.items():
        assert f"export {var}={shlex.quote(value)}" in text


def test_output_file_written_executable(tmp_path, capsys):
    out = tmp_path / "x" / "job.sh"
    assert main(["jobscript", str(CONFIG), "--system", "frontier", "--nodes", "1", "--time",
                 "10", "--output", str(out), "--check", "none",
                 f"run.dir={tmp_path / 'run'}"]) == 0
    assert out.exists() and os.access(out, os.X_OK)
    assert (tmp_path / "run").is_dir()  # the scheduler's output file goes there
    assert f"SPMD_SCRIPT={out}" in out.read_text()


# ---------------------------------------------------------------- pure functions


@pytest.mark.parametrize("text,seconds", [
    ("30", 1800), ("5", 300), ("1:30", 5400), ("01:30:00", 5400), ("0:00:20", 20),
    ("2-00:00:00", 172800), ("1-2:03:04", 93784),
])
def test_parse_walltime(text, seconds):
    assert parse_walltime(text) == seconds


@pytest.mark.parametrize("text", ["", "abc", "1:75", "0", "0:00", "1:2:3:4", "-5", "1h", "1:30:99"])
def test_parse_walltime_rejects(text):
    from spmd.errors import SpmdError

    with pytest.raises(SpmdError, match="--time"):
        parse_walltime(text)


def test_format_walltime():
    assert format_walltime(5400, "lsf") == "1:30"
    assert format_walltime(100, "lsf") == "0:02"  # rounded up to a minute
    assert format_walltime(5400, "pbs") == "01:30:00"
    assert format_walltime(90000, "slurm") == "1-01:00:00"
    assert format_walltime(5400, "flux") == "90m"
    assert format_walltime(20, "flux") == "20s"


def test_submit_commands_and_job_ids(tmp_path):
    s = tmp_path / "job.sh"
    assert submit_argv("slurm", s, "41") == (
        ["sbatch", "--parsable", "--dependency=afterany:41", str(s)], None)
    assert submit_argv("lsf", s, "41") == (["bsub", "-w", "ended(41)"], s)
    assert submit_argv("pbs", s, "41.pbs", chain_next=True) == (
        ["qsub", "-W", "depend=afterany:41.pbs", "-v", "SPMD_CHAIN_NEXT=1", str(s)], None)
    assert submit_argv("flux", s, "fABC") == (
        ["flux", "batch", "--dependency=afterany:fABC", str(s)], None)
    assert parse_job_id("slurm", "123;cluster\n") == "123"
    assert parse_job_id("lsf", "Job <4567> is submitted to queue <batch>.\n") == "4567"
    assert parse_job_id("pbs", "789.polaris-pbs-01.hsn.cm.polaris.alcf.anl.gov\n") == \
        "789.polaris-pbs-01.hsn.cm.polaris.alcf.anl.gov"
    assert parse_job_id("flux", "ƒ2Ju4PVm\n") == "ƒ2Ju4PVm"


def test_profiles_are_complete():
    from spmd.errors import SpmdError

    assert {"slurm", "frontier", "perlmutter", "summit", "polaris", "flux"} <= set(SYSTEMS)
    for p in SYSTEMS.values():
        assert p.scheduler in ("slurm", "lsf", "pbs", "flux")
        assert p.ranks_per_node >= 1
        assert p.gpus_per_node == 0 or p.device_memory_bytes
    assert SYSTEMS["frontier"].device_memory_bytes == 64 << 30
    assert SYSTEMS["summit"].gpus_per_node == 6
    with pytest.raises(SpmdError, match="valid systems: slurm, frontier"):
        system_profile("nope")


def test_constants_match_launch_and_trainer():
    import spmd.loop.hook_chain
    from spmd import launch

    assert ExitCode.PREEMPTED == 75  # the one table; the script below renders it
    assert HALT_FILE_NAME == spmd.loop.hook_chain.HALT_FILE_NAME == launch.HALT_FILE_NAME == "HALT"


def test_profile_xla_flags_parse_in_installed_jaxlib():
    """XLA aborts on an unknown flag: every profile's flags must parse (checked on CPU)."""
    flags = sorted({f for p in SYSTEMS.values() for f in p.xla_flags} | set(GPU_XLA_FLAGS))
    env = {**os.environ, "XLA_FLAGS": " ".join(flags), "JAX_PLATFORMS": "cpu"}
    code = "import jax.numpy as j; print(float(j.ones(2).sum()))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "2.0", r.stderr[-2000:]


# ---------------------------------------------------------------- bad input (real CLI)


@pytest.mark.parametrize("args,needle", [
    (["--system", "nope", "--nodes", "1", "--time", "5"], "--system"),
    (["--system", "slurm", "--nodes", "1", "--time", "7x"], "--time"),
    (["--system", "slurm", "--nodes", "0", "--time", "5"], "--nodes"),
    (["--system", "slurm", "--nodes", "1", "--time", "5", "--chain", "0"], "--chain"),
    (["--system", "slurm", "--nodes", "1", "--time", "5", "train.stepz=3"], "train.stepz"),
    (["--system", "slurm", "--nodes", "1", "--time", "5", "--env", "1BAD"], "--env"),
    (["--system", "summit", "--nodes", "1", "--time", "5", "--submit", "--check", "none",
      "run.dir=/tmp/spmd-x"], "bsub"),
    (["--system", "slurm", "--nodes", "1", "--time", "5", "--setup", "site/env.sh"], "--setup"),
])
def test_bad_input_names_the_option(args, needle, tmp_path):
    env = {**os.environ, "PATH": f"{tmp_path}:{Path(sys.executable).parent}:/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-m", "spmd.cli", "jobscript", str(CONFIG), *args],
                       capture_output=True, text=True, env=env, cwd=REPO, timeout=60)
    assert r.returncode != 0
    assert needle in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    if needle == "--system":
        assert "valid systems: slurm, frontier, perlmutter" in r.stderr


# ---------------------------------------------------------------- checked for the job's world

FNO = REPO / "configs" / "fno_darcy.yaml"


def test_the_world_of_each_system():
    def request(system: str, nodes: int = 8, **options):
        return make_request(CONFIG, system=system, nodes=nodes, time="30", workdir=REPO,
                            **options)

    assert [request(s).devices for s in ("frontier", "summit", "polaris", "flux")] == \
        [64, 48, 32, 32]
    assert request("frontier").describe_world() == "frontier, 8 nodes x 8 GPUs = 64 devices"
    assert request("frontier", ranks_per_node=2).devices == 16       # --gpus-per-task=1
    assert request("perlmutter", ranks_per_node=1).devices == 32     # 1 rank drives 4 GPUs
    assert request("slurm", nodes=2, gpus_per_node=4).devices == 8
    cpu = request("slurm", nodes=2, ranks_per_node=2, env=["JAX_NUM_CPU_DEVICES=3"])
    assert cpu.devices == 12 and cpu.describe_world().endswith("6 CPU devices = 12 devices")
    from spmd.errors import SpmdError

    with pytest.raises(SpmdError, match="--ranks-per-node 3 does not divide the 4 GPUs"):
        request("perlmutter", ranks_per_node=3)


def check_cli(capsys, *args: str) -> tuple[int, str, str]:
    """`spmd jobscript` in this process, whose 8 CPU devices stand in for the 8 GPUs of 2 nodes
    of the generic Slurm profile (which knows no device memory: no compile)."""
    code = main(["jobscript", str(CONFIG), "--system", "slurm", "--nodes", "2",
                 "--gpus-per-node", "4", "--time", "10", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_batch_the_world_does_not_divide_fails_in_one_line(capsys, tmp_path):
    code, out, err = check_cli(capsys, "train.batch_size=12", f"run.dir={tmp_path / 'run'}")
    assert code == ExitCode.USER_ERROR and out == ""
    assert err.strip() == (
        f"spmd jobscript: error: {CONFIG} for slurm, 2 nodes x 4 GPUs = 8 devices: "
        "train.batch_size=12 does not divide over the 8 data-parallel ways (mesh data=8); "
        "use a multiple of 8: 8 or 16")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("overrides,needles", [
    (["mesh.strategy=fsdp", "mesh.axes.data=2", "train.batch_size=6"],
     ["train.batch_size=6 does not divide over the 8 data-parallel ways (mesh data=2 x fsdp=4)",
      "use a multiple of 8: 8 or 16"]),
    (["mesh.axes.data=3"], ["mesh.axes", "8 devices"]),
    (["train.microbatches=2"], ["train.microbatches=2 needs pipeline stages"]),
    (["train.grad_accum=4"], ["train.batch_size=16", "train.grad_accum=4", "8 data-parallel",
                              "use a multiple of 32: 32 or 64"]),
], ids=["batch-over-data-x-fsdp", "mesh-product", "microbatches", "grad-accum"])
def test_world_checks_name_the_key_to_change(overrides, needles, capsys, tmp_path):
    code, out, err = check_cli(capsys, *overrides, f"run.dir={tmp_path / 'run'}")
    assert code == ExitCode.USER_ERROR and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "for slurm, 2 nodes x 4 GPUs = 8 devices: " in lines[0], err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def test_spmd_plan_names_train_batch_size_the_same_way(capsys):
    assert main(["plan", str(CONFIG), "--devices", "8", "train.batch_size=100"]) == \
        ExitCode.USER_ERROR
    assert capsys.readouterr().err.strip() == (
        "spmd plan: error: train.batch_size=100 does not divide over the 8 data-parallel ways "
        "(mesh data=8); use a multiple of 8: 96 or 104")


def test_a_failed_check_writes_and_submits_nothing(capsys, tmp_path, monkeypatch):
    bin_dir, calls = tmp_path / "bin", tmp_path / "sbatch-calls"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f"#!/bin/bash\necho \"$@\" >> {calls}\necho 1\n")
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    script = tmp_path / "job.sh"
    code, out, err = check_cli(capsys, "--submit", "--chain", "3", "--output", str(script),
                               "train.batch_size=12", f"run.dir={tmp_path / 'run'}")
    assert code == ExitCode.USER_ERROR and "train.batch_size=12" in err and out == ""
    assert not script.exists() and not calls.exists() and not (tmp_path / "run").exists()


def test_a_config_that_fits_the_world_renders(capsys, tmp_path):
    code, out, err = check_cli(capsys, f"run.dir={tmp_path / 'run'}")
    assert code == 0 and out.startswith("#!/bin/bash\n")
    assert "spmd jobscript: checked for slurm, 2 nodes x 4 GPUs = 8 devices: mesh data=8" in err
    assert "memory not checked: the 'slurm' profile does not know its device memory" in err


def test_setup_lines_run_before_the_launch_line(capsys, tmp_path):
    setup = tmp_path / "site.sh"
    setup.write_text("#!/bin/bash\nmodule load cray-python\nsource /opt/venv/bin/activate\n\n")
    text = render_cli(capsys, "--system", "frontier", "--nodes", "2", "--time", "30", "-A", "a",
                      "--setup", str(setup), "--setup", "export SITE=1")
    lines = text.splitlines()
    order = [lines.index(x) for x in (
        "set +u  # module and activate scripts may read unset variables",
        *SYSTEMS["frontier"].setup, "module load cray-python", "source /opt/venv/bin/activate",
        "export SITE=1")]
    assert order == sorted(order), order
    assert lines[order[-1] + 1] == "set -u"
    launch = next(i for i, line in enumerate(lines) if line.startswith("srun "))
    assert order[-1] < lines.index("export GPU_MAX_HW_QUEUES=2") < launch
    assert "#!/bin/bash" not in lines[1:]     # the file's own #! line is left out
    assert f"--setup {setup} --setup 'export SITE=1'" in text  # the command that renders it
    path = tmp_path / "job.sh"
    path.write_text(text)
    r = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_a_profile_without_setup_renders_none(capsys):
    text = render_cli(capsys, "--system", "polaris", "--nodes", "1", "--time", "30", "-A", "a")
    assert not SYSTEMS["polaris"].setup and "Site set-up" not in text and "set +u" not in text


@pytest.mark.slow   # 2 x `spmd jobscript` on 32-64 stand-in devices, about 7 s each
@pytest.mark.parametrize("system,batch", [("frontier", 64), ("summit", 48), ("polaris", 64)])
def test_readme_example_is_checked_for_the_machine(system, batch, tmp_path):
    args = ["jobscript", str(FNO), "--system", system, "--nodes", "8", "--time", "2:00:00",
            "--account", "ABC", f"run.dir={tmp_path / 'run'}"]
    r = run_spmd(*args)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == ExitCode.USER_ERROR and r.stdout == "" and len(lines) == 1, r.stderr
    ways = SYSTEMS[system].gpus_per_node * 8
    assert f"train.batch_size=16 does not divide over the {ways} data-parallel ways" in lines[0]
    assert f"use a multiple of {ways}: {ways} or {2 * ways}" in lines[0]
    assert not (tmp_path / "run").exists()

    r = run_spmd(*args, "--setup", "module load site-env", f"train.batch_size={batch}")
    assert r.returncode == 0, r.stderr
    assert f"checked for {system}, 8 nodes x {SYSTEMS[system].gpus_per_node} GPUs" in r.stderr
    lines = r.stdout.splitlines()
    launch = next(i for i, line in enumerate(lines)
                  if line.startswith(("srun ", "jsrun ", "mpiexec ")))
    assert lines.index("module load site-env") < launch


@pytest.mark.slow   # compiles the step for 6 stand-in devices
def test_memory_that_does_not_fit_fails_before_the_queue(tmp_path):
    r = run_spmd("jobscript", str(CONFIG), "--system", "summit", "--nodes", "1", "--time", "30",
                 "-A", "a", "train.batch_size=12", "model.d_in=8192", "model.d_hidden=65536",
                 f"run.dir={tmp_path / 'run'}")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == ExitCode.DOES_NOT_FIT and r.stdout == "" and len(lines) == 1, r.stderr
    assert "summit, 1 node x 6 GPUs = 6 devices: does not fit summit" in lines[0]


# ---------------------------------------------------------------- the script's logic, for real

FAKE_RANK = r'''
import json, os, signal, sys, time
from pathlib import Path
out = Path(os.environ["FAKE_OUT"])
rank = os.environ.get("SLURM_PROCID", "0")
got = []
for s in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM):
    signal.signal(s, lambda n, f: got.append(n))
halt = Path(os.environ["FAKE_RUN_DIR"]) / "HALT"
info = {"pid": os.getpid(), "halt_at_start": halt.exists(),
        "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "restart": os.environ.get("SLURM_RESTART_COUNT")}
(out / f"ready.{rank}").write_text(json.dumps(info))
mode = os.environ.get("FAKE_MODE", "wait")
if info["restart"] and int(info["restart"]) >= 1:
    mode = "exit:0"  # a requeued run finishes at once
if mode == "hung":  # as the hang watchdog's reporter: run.dir/HUNG, and statuses mixed
    (Path(os.environ["FAKE_RUN_DIR"]) / "HUNG").write_text(json.dumps({"line": "hang: ..."}))
    sys.exit(205)
if mode.startswith("exit:"):
    sys.exit(int(mode[5:]))
deadline = time.time() + float(os.environ.get("FAKE_WAIT_S", "30"))
while not got and time.time() < deadline:
    time.sleep(0.02)
(out / f"signals.{rank}").write_text(",".join(signal.Signals(s).name for s in got))
sys.exit(75 if got else 0)
'''

STUB = r'''#!/bin/bash
name=$(basename "$0")
echo "$name $*" >> "$STUB_LOG"
rc_var="STUB_RC_${name}"
case "$name" in
  srun|jsrun|mpiexec) ;;
  flux)
    case "$1" in
      run) shift ;;
      --parent) echo "fNEW"; exit 0 ;;
      *) exit 1 ;;  # flux job last / kill: fall back to kill(1)
    esac ;;
  qsub) echo "999.pbs"; exit "${!rc_var:-0}" ;;
  *) exit "${!rc_var:-0}" ;;
esac
while [ $# -gt 0 ]; do
  case "$1" in
    "$STUB_PY"|*/.spmd-bind-*.sh) exec "$@" ;;
  esac
  shift
done
echo "stub $name: no command to run" >&2
exit 99
'''

JOB_ENV = {"SLURM_JOB_ID": "123", "LSB_JOBID": "123", "PBS_JOBID": "123.pbs",
           "FLUX_JOB_ID": "fABC"}
REQUEUE = {"slurm": "scontrol requeue 123", "summit": "brequeue 123",
           "polaris": "qrerun 123.pbs", "flux": "flux --parent batch"}


@dataclasses.dataclass
class Harness:
    root: Path
    script: Path
    env: dict[str, str]
    log: Path
    out: Path
    run_dir: Path

    def start(self, **extra: str) -> subprocess.Popen:
        env = {**self.env, **extra}
        return subprocess.Popen(["bash", str(self.script)], env=env, cwd=self.root,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)

    def wait_ready(self, proc: subprocess.Popen, timeout: float = 20.0) -> dict:
        ready = self.out / "ready.0"
        deadline = time.monotonic() + timeout
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise AssertionError(f"fake rank never started:\n{proc.communicate()[0]}")
            time.sleep(0.02)
        time.sleep(0.1)  # the rank's handlers are installed before it writes ready
        return json.loads(ready.read_text())

    def finish(self, proc: subprocess.Popen, timeout: float = 20.0) -> tuple[int, str]:
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            raise AssertionError(f"job script did not finish:\n{out}") from None
        return proc.returncode, out

    def calls(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []

    def signals(self) -> str:
        p = self.out / "signals.0"
        return p.read_text() if p.exists() else ""


def make_harness(tmp_path: Path, system: str, time_: str = "1:30", **kw) -> Harness:
    bindir, out, run_dir = tmp_path / "bin", tmp_path / "out", tmp_path / "run"
    for d in (bindir, out):
        d.mkdir()
    for name in ("srun", "jsrun", "mpiexec", "flux", "scontrol", "brequeue", "qrerun", "qsub"):
        (bindir / name).write_text(STUB)
        (bindir / name).chmod(0o755)
    rank = tmp_path / "fake_rank.py"
    rank.write_text(FAKE_RANK)
    req = make_request(CONFIG, system=system, nodes=1, time=time_, account="acct",
                       overrides=[f"run.dir={run_dir}"], workdir=REPO, **kw)
    req = dataclasses.replace(req, command=(sys.executable, str(rank)))
    script = write_script(req, tmp_path / "job.sh")
    env = {**os.environ, **JOB_ENV, "PATH": f"{bindir}:{os.environ['PATH']}",
           "STUB_LOG": str(tmp_path / "calls.log"), "STUB_PY": sys.executable,
           "FAKE_OUT": str(out), "FAKE_RUN_DIR": str(run_dir), "PALS_LOCAL_RANKID": "1"}
    return Harness(tmp_path, script, env, tmp_path / "calls.log", out, run_dir)


@pytest.mark.parametrize("system", ["slurm", "summit", "polaris", "flux"])
def test_warning_is_forwarded_and_job_requeued(system, tmp_path):
    h = make_harness(tmp_path, system)
    proc = h.start()
    info = h.wait_ready(proc)
    os.kill(proc.pid, signal.SIGUSR1)
    code, out = h.finish(proc)
    assert code == 0, out
    assert h.signals() == "SIGUSR2", out  # forwarded as SIGUSR2 through the launcher
    requeues = [c for c in h.calls() if c.startswith(REQUEUE[system])]
    assert len(requeues) == 1, (h.calls(), out)
    assert not (h.run_dir / HALT_FILE_NAME).exists()  # its own halt file is cleaned up
    if system == "polaris":
        assert info["CUDA_VISIBLE_DEVICES"] == "2"  # 4 - 1 - local rank 1
        assert any(c.startswith("mpiexec -n 4 -ppn 4") for c in h.calls())


@pytest.mark.parametrize("system", ["slurm", "summit"])
def test_hung_ranks_are_requeued_as_after_a_failed_node(system, tmp_path):
    h = make_harness(tmp_path, system)
    code, out = h.finish(h.start(FAKE_MODE="hung"))
    assert code == 0, out                       # requeued
    assert "ranks hung" in out and "hang: ..." in out
    assert [c for c in h.calls() if c.startswith(REQUEUE[system])], h.calls()
    h.log.unlink()
    code, out = h.finish(h.start(FAKE_MODE="hung", STUB_RC_scontrol="1", STUB_RC_brequeue="1"))
    assert code == int(ExitCode.HUNG), out      # could not requeue: the job says why it ended


def test_a_hang_report_of_an_earlier_job_is_not_this_job_s(tmp_path):
    h = make_harness(tmp_path, "slurm")
    h.run_dir.mkdir(parents=True, exist_ok=True)
    (h.run_dir / "HUNG").write_text("{}")
    code, out = h.finish(h.start(FAKE_MODE="exit:3"))
    assert code == 3, out
    assert not any(c.startswith("scontrol") for c in h.calls()), h.calls()


def test_slurm_cancel_saves_but_does_not_requeue(tmp_path):
    h = make_harness(tmp_path, "slurm")
    proc = h.start()
    h.wait_ready(proc)
    os.kill(proc.pid, signal.SIGTERM)
    code, out = h.finish(proc)
    assert code == int(ExitCode.PREEMPTED), out
    assert h.signals() == "SIGUSR2"
    assert not any(c.startswith("scontrol") for c in h.calls()), h.calls()
    assert "not requeueing" in out


def test_pbs_sigterm_requeues(tmp_path):
    h = make_harness(tmp_path, "polaris")
    proc = h.start()
    h.wait_ready(proc)
    os.kill(proc.pid, signal.SIGTERM)
    code, out = h.finish(proc)
    assert code == 0 and "qrerun 123.pbs" in h.calls(), out


def test_pbs_resubmits_when_qrerun_is_refused(tmp_path):
    h = make_harness(tmp_path, "polaris")
    proc = h.start(STUB_RC_qrerun="1")
    h.wait_ready(proc)
    os.kill(proc.pid, signal.SIGUSR1)
    code, out = h.finish(proc)
    assert code == 0, out
    assert f"qsub -v SPMD_CHAIN=123.pbs {h.script}" in h.calls(), h.calls()
    assert "resubmitted as 999.pbs" in out


def test_pbs_chained_job_leaves_it_to_the_next(tmp_path):
    h = make_harness(tmp_path, "polaris")
    proc = h.start(STUB_RC_qrerun="1", SPMD_CHAIN_NEXT="1")
    h.wait_ready(proc)
    os.kill(proc.pid, signal.SIGUSR1)
    code, out = h.finish(proc)
    assert code == 0, out
    assert not any(c.startswith("qsub") for c in h.calls()), h.calls()


def test_pbs_walltime_watchdog_warns(tmp_path):
    h = make_harness(tmp_path, "polaris", time_="0:00:12", signal_lead_s=10)
    t0 = time.monotonic()
    proc = h.start()
    code, out = h.finish(proc, timeout=25)
    assert code == 0 and "qrerun 123.pbs" in h.calls(), out
    assert h.signals() == "SIGUSR2" and 1.5 < time.monotonic() - t0 < 15, out


@pytest.mark.parametrize("rank_exit", [0, 3])
def test_other_exit_status_passes_through(rank_exit, tmp_path):
    h = make_harness(tmp_path, "slurm")
    code, out = h.finish(h.start(FAKE_MODE=f"exit:{rank_exit}"))
    assert code == rank_exit, out
    assert not any(c.startswith("scontrol") for c in h.calls())


def test_user_halt_file_stops_without_requeue(tmp_path):
    h = make_harness(tmp_path, "slurm")
    h.run_dir.mkdir(exist_ok=True)
    (h.run_dir / HALT_FILE_NAME).write_text("")  # a user asks the run to stop
    code, out = h.finish(h.start(FAKE_MODE=f"exit:{int(ExitCode.PREEMPTED)}"))
    assert code == int(ExitCode.PREEMPTED), out
    assert not any(c.startswith("scontrol") for c in h.calls())
    assert (h.run_dir / HALT_FILE_NAME).exists() and "halt file" in out


def test_stale_halt_file_of_the_script_is_removed(tmp_path):
    h = make_harness(tmp_path, "slurm")
    h.run_dir.mkdir(exist_ok=True)
    (h.run_dir / HALT_FILE_NAME).write_text("spmd-job 122 SIGUSR1 0\n")
    proc = h.start(FAKE_MODE="exit:0")
    code, out = h.finish(proc)
    info = json.loads((h.out / "ready.0").read_text())
    assert code == 0 and info["halt_at_start"] is False, out


def test_render_is_deterministic():
    req = make_request(CONFIG, system="frontier", nodes=2, time="30", workdir=REPO)
    assert render(req) == render(req)


def test_more_ranks_than_gpus_is_refused():
    from spmd.errors import SpmdError

    with pytest.raises(SpmdError, match="--ranks-per-node 9 is more than the 8 GPUs"):
        make_request(CONFIG, system="frontier", nodes=1, time="5", ranks_per_node=9,
                     workdir=REPO)
