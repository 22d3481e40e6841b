#!/usr/bin/env bash
# Wheels for a GPU node whose image has jax 0.11.2, flax, optax, orbax-checkpoint, h5py,
# xarray, tensorstore, mpi4py and the like, but not the rest of spmd's needs (pydantic,
# grain, the mpich wheel, zarr, h5netcdf, ...), and cannot reach a package index.
#
#   bash benchmarks/gpu_wheels.sh download   # here, with an index: cp312 manylinux wheels
#                                            # and spmd's own wheel into .whl/ (ignored)
#   bash benchmarks/gpu_wheels.sh check      # here: resolve them with --no-index against an
#                                            # environment that has the image's packages
#   source benchmarks/gpu_wheels.sh install  # on the node: into /tmp/site, PYTHONPATH set
#
# With the device tool: carry [".whl"] and begin the command with
#   source benchmarks/gpu_wheels.sh install && python benchmarks/gpu_check.py --out $OUT
# The newest stack the image can take: the versions of constraints/py313.txt (the newest stack
# CI tests) for every pure-Python package and every small wheel, and the image's own jax/jaxlib
# 0.11.2 with its CUDA 13 plugin, since jaxlib 0.12 and its plugin are 220 MB of wheels, more
# than the device tool carries (64 MiB). On 0.11.2 spmd's host snapshot works around the
# release's lost donation (docs/install.md). One version of each (two stop the install).
WHEELS=(
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  grain==0.2.18 array-record==0.8.6 portpicker==1.6.0 flax==0.12.12
  zarr==3.4.2 numcodecs==0.17.1 donfig==0.8.1.post1 msgspec==0.22.0 google-crc32c==1.9.0
  h5netcdf==1.8.2 tensorboardX==2.6.5 mpich==5.0.2
)
SITE=${SPMD_WHEEL_SITE:-/tmp/site}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

case "${1:-}" in
download)
  set -euo pipefail
  cd "$REPO"
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d .whl "${WHEELS[@]}"
  rm -f .whl/spmd_hpc-*.whl
  python3 -m pip wheel --no-deps -w .whl .    # spmd itself (pure Python)
  ls .whl
  ;;
check)
  set -euo pipefail
  cd "$REPO"
  # every carried wheel's needs resolve from what is installed (the image) and .whl/ alone
  python3 -m pip install --dry-run --no-index --find-links .whl "${WHEELS[@]}"
  # and spmd's own: each requirement met by the image or a carried wheel; the image's jax and
  # jaxlib 0.11.2, which the pins leave out, are accepted (spmd works around the release)
  python3 - "${WHEELS[@]}" <<'PY'
import glob, sys, zipfile
from importlib import metadata
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name as canon

carried = {canon(w.split("==")[0]): w.split("==")[1] for w in sys.argv[1:]}
wheel = glob.glob(".whl/spmd_hpc-*.whl")[0]
with zipfile.ZipFile(wheel) as z:
    meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
unmet = []
for line in meta.splitlines():
    if not line.startswith("Requires-Dist:"):
        continue
    req = Requirement(line.split(":", 1)[1].strip())
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    name = canon(req.name)
    try:
        version = carried.get(name) or metadata.version(req.name)
    except metadata.PackageNotFoundError:
        unmet.append(f"{req} (missing)")
        continue
    if req.specifier.contains(version, prereleases=True):
        continue
    if name in ("jax", "jaxlib") and version == "0.11.2":
        print(f"accepted: {req.name} {version} (the image's; spmd's host snapshot works "
              f"around its lost donation, docs/install.md)")
        continue
    unmet.append(f"{req} (found {version})")
print("spmd's requirements:", "; ".join(unmet) if unmet else "all met")
sys.exit(1 if unmet else 0)
PY
  ;;
install)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "$REPO"/.whl/*.whl && export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  ;;
*)
  echo "usage: bash benchmarks/gpu_wheels.sh download|check, or source it with install" >&2
  false
  ;;
esac
