"""Launch resolution from what each launcher sets: `spmd doctor --json` in a clean environment.

Each case is rank 5 of 8, four ranks per node (so node 1, local rank 1), with the variables
that launcher really sets and none of the others. No MPI here (SPMD_MPI=0): resolution from
the environment alone, as on a system whose launcher we cannot run. Every multi-rank case
(each launcher, Slurm's cyclic distribution, the human output) runs in one child process
(tests/helpers/cli_batch.py: one `spmd doctor` per case, each in its own environment)
rather than one process each; the single-process case, which starts JAX, runs on its own.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from spmd.launch.coordinator import derived_port
from tests.helpers.cli_batch import run_batch
from tests.helpers.env import clean_env, run_spmd

RANK5_OF_8 = dict(rank=5, size=8, local_rank=1, local_size=4, node_id=1, num_nodes=2,
                  node_of_rank=[0, 0, 0, 0, 1, 1, 1, 1])

CASES = {
    "slurm": (
        dict(SLURM_JOB_ID="4242", SLURM_STEP_ID="0", SLURM_PROCID="5", SLURM_NTASKS="8",
             SLURM_LOCALID="1", SLURM_NODEID="1", SLURM_NNODES="2",
             SLURM_STEP_NODELIST="nid[001-002]", SLURM_STEP_TASKS_PER_NODE="4(x2)",
             SLURM_RESTART_COUNT="2"),
        dict(rank="SLURM_PROCID", size="SLURM_NTASKS", local_rank="SLURM_LOCALID",
             local_size="SLURM_STEP_TASKS_PER_NODE[SLURM_NODEID]", node_id="SLURM_NODEID",
             job_id="SLURM_JOB_ID", restart_count="SLURM_RESTART_COUNT"),
        f"nid001:{derived_port('4242', '0', 2)}",
    ),
    "flux": (
        dict(FLUX_JOB_ID="ƒ2Xb8pPq5", FLUX_TASK_RANK="5", FLUX_JOB_SIZE="8",
             FLUX_TASK_LOCAL_ID="1", FLUX_JOB_NNODES="2", FLUX_URI="local:///tmp/flux"),
        dict(rank="FLUX_TASK_RANK", size="FLUX_JOB_SIZE", local_rank="FLUX_TASK_LOCAL_ID",
             node_id="block layout, 4 ranks per node (FLUX_JOB_SIZE/FLUX_JOB_NNODES)",
             job_id="FLUX_JOB_ID"),
        None,  # no host list without MPI: doctor reports it as a problem
    ),
    "jsrun": (  # jsrun (Spectrum MPI) also sets OMPI_COMM_WORLD_*: jsrun must win
        dict(LSB_JOBID="77", LSB_HOSTS="batch3 " + "h1 " * 4 + "h2 " * 4,
             JSM_NAMESPACE_RANK="5", JSM_NAMESPACE_SIZE="8", JSM_NAMESPACE_LOCAL_RANK="1",
             JSM_NAMESPACE_LOCAL_SIZE="4", OMPI_COMM_WORLD_RANK="5", OMPI_COMM_WORLD_SIZE="8"),
        dict(rank="JSM_NAMESPACE_RANK", size="JSM_NAMESPACE_SIZE",
             local_rank="JSM_NAMESPACE_LOCAL_RANK", local_size="JSM_NAMESPACE_LOCAL_SIZE",
             job_id="LSB_JOBID"),
        f"h1:{derived_port('77', '0', 0)}",
    ),
    "pals": (
        dict(PBS_JOBID="123.polaris-pbs-01", PALS_RANKID="5", PALS_LOCAL_RANKID="1",
             PALS_NODEID="1", PALS_DEPTH="8", PMI_RANK="5", PMI_SIZE="8", PMI_LOCAL_RANK="1",
             PMI_LOCAL_SIZE="4"),
        dict(rank="PALS_RANKID", size="PMI_SIZE", local_rank="PALS_LOCAL_RANKID",
             local_size="PMI_LOCAL_SIZE", node_id="PALS_NODEID", job_id="PBS_JOBID"),
        f"x3001c0s13b0n0:{derived_port('123.polaris-pbs-01', '0', 0)}",
    ),
    "openmpi4": (
        dict(OMPI_COMM_WORLD_RANK="5", OMPI_COMM_WORLD_SIZE="8", OMPI_COMM_WORLD_LOCAL_RANK="1",
             OMPI_COMM_WORLD_LOCAL_SIZE="4", OMPI_COMM_WORLD_NODE_RANK="1",
             OMPI_MCA_orte_hnp_uri="1234.0;tcp://10.0.0.1:40000"),
        dict(launcher="OMPI_COMM_WORLD_RANK (Open MPI 4, OMPI_MCA_orte_hnp_uri)",
             rank="OMPI_COMM_WORLD_RANK", size="OMPI_COMM_WORLD_SIZE",
             local_rank="OMPI_COMM_WORLD_LOCAL_RANK", local_size="OMPI_COMM_WORLD_LOCAL_SIZE"),
        None,
    ),
    "openmpi5": (
        dict(OMPI_COMM_WORLD_RANK="5", OMPI_COMM_WORLD_SIZE="8", OMPI_COMM_WORLD_LOCAL_RANK="1",
             OMPI_COMM_WORLD_LOCAL_SIZE="4", PMIX_RANK="5", PMIX_NAMESPACE="prterun-h1-1@1",
             PRTE_LAUNCHED="1"),
        dict(launcher="OMPI_COMM_WORLD_RANK (Open MPI 5, PMIX_RANK)",
             rank="OMPI_COMM_WORLD_RANK", size="OMPI_COMM_WORLD_SIZE"),
        None,
    ),
    "hydra": (
        dict(PMI_RANK="5", PMI_SIZE="8", MPI_LOCALRANKID="1", MPI_LOCALNRANKS="4",
             PMI_HOSTNAME="h2"),
        dict(rank="PMI_RANK", size="PMI_SIZE", local_rank="MPI_LOCALRANKID",
             local_size="MPI_LOCALNRANKS"),
        None,
    ),
    "explicit": (  # explicit variables win over a Slurm step's
        dict(SPMD_RANK="5", SPMD_SIZE="8", SPMD_LOCAL_RANK="1", SPMD_LOCAL_SIZE="4",
             SPMD_NODE_ID="1", SPMD_COORDINATOR="h1:1234", SLURM_JOB_ID="9", SLURM_PROCID="0",
             SLURM_NTASKS="2"),
        dict(launcher="SPMD_RANK", rank="SPMD_RANK", size="SPMD_SIZE",
             local_rank="SPMD_LOCAL_RANK", local_size="SPMD_LOCAL_SIZE", node_id="SPMD_NODE_ID",
             coordinator="SPMD_COORDINATOR"),
        "h1:1234",
    ),
    "explicit_jax": (
        dict(JAX_PROCESS_ID="5", JAX_NUM_PROCESSES="8", JAX_COORDINATOR_ADDRESS="h1:4321",
             SPMD_LOCAL_RANK="1", SPMD_LOCAL_SIZE="4"),
        dict(rank="JAX_PROCESS_ID", size="JAX_NUM_PROCESSES",
             coordinator="JAX_COORDINATOR_ADDRESS"),
        "h1:4321",
    ),
}
LAUNCHER = {"openmpi4": "openmpi", "openmpi5": "openmpi", "explicit_jax": "explicit"}


CYCLIC = dict(SLURM_JOB_ID="1", SLURM_PROCID="5", SLURM_NTASKS="8", SLURM_LOCALID="2",
              SLURM_NODEID="1", SLURM_STEP_TASKS_PER_NODE="4(x2)",
              SLURM_DISTRIBUTION="cyclic", SLURM_STEP_NODELIST="a,b")
HUMAN = dict(SLURM_JOB_ID="4242", SLURM_PROCID="1", SLURM_NTASKS="2", SLURM_LOCALID="1",
             SLURM_NODEID="0", SLURM_STEP_TASKS_PER_NODE="2", SLURM_STEP_NODELIST="n1")


@pytest.fixture(scope="module")
def doctor(tmp_path_factory) -> dict[str, SimpleNamespace]:
    """`spmd doctor [--json]` of every case, run in one child process: name -> result
    (returncode, stdout, stderr)."""
    nodefile = tmp_path_factory.mktemp("pals") / "nodefile"
    nodefile.write_text("x3001c0s13b0n0\nx3001c0s19b0n0\n")
    runs = {case: (dict(variables, PBS_NODEFILE=str(nodefile)) if case == "pals"
                   else variables, ["doctor", "--json"])
            for case, (variables, _, _) in CASES.items()}
    runs["cyclic"] = (CYCLIC, ["doctor", "--json"])
    runs["human"] = (HUMAN, ["doctor"])
    results = run_batch([(clean_env(SPMD_MPI="0", **variables), args)
                         for variables, args in runs.values()], timeout=120)
    return dict(zip(runs, results))


@pytest.mark.parametrize("case", sorted(CASES))
def test_doctor_resolves_launcher(case, doctor):
    _, sources, coordinator = CASES[case]
    result = doctor[case]
    assert result.returncode in (0, 1), result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    report = json.loads(result.stdout)
    for key, value in RANK5_OF_8.items():
        assert report[key] == value, (key, report)
    assert report["launcher"] == LAUNCHER.get(case, case)
    for key, source in sources.items():
        assert report["sources"][key] == source, (key, report["sources"])
    if coordinator is None:  # no MPI and no host list: doctor says what to set
        assert result.returncode == 1
        assert "SPMD_COORDINATOR" in report["problems"][0], report["problems"]
    else:
        assert result.returncode == 0, report["problems"]
        assert report["coordinator"] == coordinator


def test_slurm_cyclic_distribution(doctor):
    result = doctor["cyclic"]
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["node_of_rank"] == [0, 1, 0, 1, 0, 1, 0, 1]
    assert (report["node_id"], report["local_rank"], report["local_size"]) == (1, 2, 4)
    assert report["coordinator"].startswith("a:")


def test_single_process_lists_jax_devices():
    result = run_spmd("doctor", "--json", env=clean_env(JAX_NUM_CPU_DEVICES="3"), timeout=60)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert (report["launcher"], report["rank"], report["size"]) == ("single", 0, 1)
    assert report["coordinator"] is None
    assert report["devices"]["platform"] == "cpu"
    assert report["jax"]["device_count"] == 3


def test_human_output_names_sources(doctor):
    result = doctor["human"]
    assert result.returncode == 0, result.stderr
    assert "rank 1 of 2" in result.stdout
    assert "<- SLURM_PROCID" in result.stdout
    assert "127.0.0.1:" in result.stdout  # every rank on this host
