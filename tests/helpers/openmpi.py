"""A real Open MPI for the tests: Debian's `openmpi-bin`, installed with apt when missing.

`open_mpi()` returns Debian's launcher (`mpirun.openmpi`, not the `mpirun` of the embedded
MPICH that may come first on PATH) and its `libmpi.so.40`. The installed mpi4py wheel runs on
either MPI: `MPI4PY_LIBMPI` points it at Open MPI's library, so no second mpi4py is built.
`open_mpi_env()` is the environment a job needs: that variable, `SPMD_MPIEXEC` (spmd run's
launcher), and Open MPI's consent to run as root.
Locally a missing Open MPI that cannot be installed skips the test; on CI it fails it.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

LAUNCHER = "mpirun.openmpi"


@dataclass(frozen=True)
class OpenMPI:
    mpirun: Path
    libmpi: Path


class OpenMPIUnavailable(RuntimeError):
    """Open MPI is missing and could not be installed; the message says why."""


def _find() -> OpenMPI | None:
    mpirun = shutil.which(LAUNCHER, path=os.environ.get("PATH", "") + os.pathsep + "/usr/bin")
    libs = sorted(glob.glob("/usr/lib/*/libmpi.so.40")) + sorted(glob.glob("/usr/lib/libmpi.so.40"))
    if mpirun is None or not libs:
        return None
    return OpenMPI(Path(mpirun), Path(libs[0]))


def open_mpi() -> OpenMPI:
    """Debian's Open MPI, installed first when missing (root and apt-get needed)."""
    found = _find()
    if found is not None:
        return found
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise OpenMPIUnavailable(f"{LAUNCHER} is missing and apt-get cannot install openmpi-bin "
                                 "here (needs root and apt-get)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "openmpi-bin"]
    # the package lists are usually fresh (the Slurm fixture updates them): update only when
    # the install without it fails
    if subprocess.run(install, capture_output=True, timeout=900, env=env).returncode != 0:
        for cmd in (["apt-get", "update", "-q"], install):
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
            if r.returncode != 0:
                raise OpenMPIUnavailable(f"{' '.join(cmd)} failed (exit {r.returncode}): "
                                         f"{(r.stderr or r.stdout)[-2000:]}")
    found = _find()
    if found is None:
        raise OpenMPIUnavailable(f"{LAUNCHER} or libmpi.so.40 still missing after apt-get install")
    return found


def open_mpi_env(ompi: OpenMPI) -> dict[str, str]:
    return {"SPMD_MPIEXEC": str(ompi.mpirun), "MPI4PY_LIBMPI": str(ompi.libmpi),
            "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
            "OMPI_MCA_btl_vader_single_copy_mechanism": "none"}
