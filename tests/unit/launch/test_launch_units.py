"""Launch building blocks in-process: layouts, overrides, device binding, ports, wall time."""

from __future__ import annotations

import socket
import stat
import time
from datetime import datetime

import pytest

from spmd.launch import LaunchError, job_end_time, resolve_launch_env
from spmd.launch.coordinator import derived_port, wait_reachable
from spmd.launch.devices import count_visible_gpus, plan
from spmd.launch.nodes import distribute, first_host, parse_tasks_per_node


def test_hostlists_and_tasks_per_node():
    assert first_host("nid[003-004,9],login1") == "nid003"
    assert first_host("c1,c2") == "c1"
    assert first_host("gpu-a[07-09]-ib") == "gpu-a07-ib"
    assert parse_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert distribute([2, 2], None) == (0, 0, 1, 1)
    assert distribute([2, 2], 1) == (0, 1, 0, 1)
    assert distribute([3, 1], 2) == (0, 0, 1, 0)


def test_processes_per_node_groups_consecutive_ranks():
    env = resolve_launch_env({"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "3",
                              "MPI_LOCALNRANKS": "4", "SPMD_PROCESSES_PER_NODE": "2"})
    assert env.node_of_rank == (0, 0, 1, 1)
    assert (env.node_id, env.num_nodes) == (1, 2)
    assert (env.local_rank, env.local_size) == (3, 4)  # the physical host, for device binding
    assert env.sources["node_id"] == "SPMD_PROCESSES_PER_NODE=2"
    with pytest.raises(LaunchError, match="SPMD_PROCESSES_PER_NODE=3"):
        resolve_launch_env({"PMI_RANK": "0", "PMI_SIZE": "4", "SPMD_PROCESSES_PER_NODE": "3"})


def test_bad_variables_are_named():
    with pytest.raises(LaunchError, match="SLURM_PROCID='x'"):
        resolve_launch_env({"SLURM_PROCID": "x", "SLURM_NTASKS": "2"})
    with pytest.raises(LaunchError, match=r"SPMD_SIZE \(or JAX_NUM_PROCESSES\) is not"):
        resolve_launch_env({"SPMD_RANK": "1"})
    with pytest.raises(LaunchError, match="PMI_RANK=4 is not a rank"):
        resolve_launch_env({"PMI_RANK": "4", "PMI_SIZE": "4"})
    with pytest.raises(LaunchError, match="SPMD_NODE_ID=0 but the node layout"):
        resolve_launch_env({"SPMD_RANK": "3", "SPMD_SIZE": "4", "SPMD_NODE_ID": "0",
                            "SPMD_LOCAL_SIZE": "2"})


def test_allocation_without_launcher_is_refused():
    for job, word in (("SLURM_JOB_ID", "srun"), ("LSB_JOBID", "jsrun"),
                      ("PBS_JOBID", "mpiexec"), ("FLUX_JOB_ID", "flux run")):
        with pytest.raises(LaunchError, match=f"run it under {word}"):
            resolve_launch_env({job: "1"})
    # ... unless a single process is asked for explicitly
    assert resolve_launch_env({"SLURM_JOB_ID": "1", "SPMD_RANK": "0", "SPMD_SIZE": "1"}).size == 1


def _env(local_rank: int, local_size: int):
    return resolve_launch_env({"SPMD_RANK": str(local_rank), "SPMD_SIZE": str(local_size),
                               "SPMD_LOCAL_RANK": str(local_rank),
                               "SPMD_LOCAL_SIZE": str(local_size)})


@pytest.mark.parametrize("visible,local_rank,local_size,ids", [
    ("0,1,2,3", 2, 4, (2,)),          # all GPUs visible -> [local_rank]
    ("3", 2, 4, (0,)),                # --gpus-per-task=1 -> [0]
    ("0,1,2,3,4,5,6,7", 1, 4, (2, 3)),  # two GPUs per rank
    ("0,1,2,3", 0, 1, (0, 1, 2, 3)),  # one process per node drives all
])
def test_gpu_binding(visible, local_rank, local_size, ids):
    environ = {"CUDA_VISIBLE_DEVICES": visible, "JAX_PLATFORMS": "cuda"}
    assert plan(_env(local_rank, local_size), environ).local_device_ids == ids


def test_gpu_binding_mismatch_is_explained():
    environ = {"CUDA_VISIBLE_DEVICES": "0,1,2", "JAX_PLATFORMS": "cuda"}
    with pytest.raises(LaunchError, match=r"sees 3 GPUs \(CUDA_VISIBLE_DEVICES='0,1,2'\) but 2 "
                                          r"ranks share this host \(SPMD_LOCAL_SIZE\)"):
        plan(_env(1, 2), environ)


def test_visible_gpu_counting():
    assert count_visible_gpus({"CUDA_VISIBLE_DEVICES": ""})[0] == 0
    assert count_visible_gpus({"CUDA_VISIBLE_DEVICES": "NoDevFiles"})[0] == 0
    assert count_visible_gpus({"CUDA_VISIBLE_DEVICES": "GPU-aa,GPU-bb"})[0] == 2
    assert count_visible_gpus({"ROCR_VISIBLE_DEVICES": "0,1,2,3", "HIP_VISIBLE_DEVICES": "1"}
                              )[0] == 1
    cpu = plan(_env(0, 1), {"JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "4"})
    assert (cpu.platform, cpu.cpu_devices, cpu.local_device_ids) == ("cpu", 4, None)


def test_derived_port_changes_with_restart():
    ports = {derived_port("4242", "0", r) for r in range(4)}
    assert len(ports) == 4 and all(61440 <= p < 65536 for p in ports)
    assert derived_port("4242", "0", 0) != derived_port("4242", "1", 0)


def test_wait_reachable_times_out_with_address():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again before the probe
    start = time.monotonic()
    with pytest.raises(LaunchError, match=f"rank 1 on h: the coordinator 127.0.0.1:{port} did "
                                          "not answer within 1 s"):
        wait_reachable(f"127.0.0.1:{port}", 1.0, "rank 1 on h")
    assert time.monotonic() - start < 3
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        wait_reachable(f"127.0.0.1:{s.getsockname()[1]}", 1.0, "rank 1 on h")


def _fake_tool(tmp_path, name: str, output: str) -> None:
    tool = tmp_path / name
    tool.write_text(f"#!/bin/sh\necho '{output}'\n")
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)


def test_job_end_time(tmp_path, monkeypatch):
    rank0 = resolve_launch_env({})
    assert job_end_time(rank0, {"SPMD_JOB_END_TIME": "1800000000"}) == 1800000000.0
    assert job_end_time(rank0, {"SLURM_JOB_END_TIME": "1800000001"}) == 1800000001.0
    assert job_end_time(rank0, {}) is None
    monkeypatch.setenv("PATH", str(tmp_path))  # no squeue at all: None, no exception
    assert job_end_time(rank0, {"SLURM_JOB_ID": "5"}) is None
    end = "2031-05-06T07:08:09"
    _fake_tool(tmp_path, "squeue", end)
    assert job_end_time(rank0, {"SLURM_JOB_ID": "5"}) == datetime.fromisoformat(end).timestamp()
    other = resolve_launch_env({"PMI_RANK": "1", "PMI_SIZE": "2"})
    assert job_end_time(other, {"SLURM_JOB_ID": "5"}) is None  # only rank 0 asks the scheduler
    _fake_tool(tmp_path, "squeue", "N/A")
    assert job_end_time(rank0, {"SLURM_JOB_ID": "5"}) is None
    _fake_tool(tmp_path, "bjobs", "1:30:00 L")
    left = job_end_time(rank0, {"LSB_JOBID": "7"})
    assert left is not None and abs(left - (time.time() + 5400)) < 5
    _fake_tool(tmp_path, "flux", '{"execution": {"expiration": 1900000000.5}}')
    assert job_end_time(rank0, {"FLUX_JOB_ID": "f1"}) == 1900000000.5
