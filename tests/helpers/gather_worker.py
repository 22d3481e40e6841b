"""One rank of the host-gather test: spmd's gather_to_host against JAX's process_allgather.

    mpiexec -n 2 python tests/helpers/gather_worker.py OUT_DIR

Each rank (4 CPU devices) gathers a global array sharded over both ranks, its own host
arrays (2-d, 1-d, 0-d) and a tree of them, under an explicit-axes mesh set as a prediction
sets it, first with JAX's `process_allgather(tiled=True)`, then with `gather_to_host`. The
last gathers use a device pattern no earlier one used (new Gloo cliques, the slow path), and
`sync_devices`, the trainer's barrier, comes last.
OUT_DIR/rank<R>.json records the values; the ranks then shut down as `spmd` does and rank 0
writes OUT_DIR/ended0 (its time) just before the interpreter exits.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np


def main(out: Path) -> None:
    from spmd.launch import bootstrap
    from spmd.launch.startup import shutdown

    env = bootstrap()
    import jax
    from jax.experimental import multihost_utils
    from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

    from spmd.comm.host_gather import gather_to_host, sync_devices

    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"),
                axis_types=(AxisType.Explicit,) * 2)
    whole = np.arange(8 * 12, dtype=np.float32).reshape(8, 12)
    sharded = jax.make_array_from_callback(
        whole.shape, NamedSharding(mesh, PartitionSpec("data", "model")), lambda i: whole[i])
    tree = {"sharded": sharded,
            "rows": np.array([[env.rank, 1], [env.rank, 2]], np.int32),
            "vector": np.array([10 * env.rank, 10 * env.rank + 1], np.int64),
            "scalar": np.float32(env.rank + 0.5)}
    with jax.set_mesh(mesh):
        theirs = {k: multihost_utils.process_allgather(v, tiled=True) for k, v in tree.items()}
        ours = gather_to_host(tree)
    last = gather_to_host(np.array([env.rank], np.int32))   # a (processes, local) pattern
    try:
        sync_devices(f"rank {env.rank}'s own name")   # the ranks disagree: every rank raises
        mismatch = None
    except RuntimeError as e:
        mismatch = str(e)
    sync_devices("spmd:gather-test")   # the trainer's barrier, last before the shutdown
    record = {"whole": whole.tolist(), "last": last.tolist(), "mismatch": mismatch,
              "theirs": {k: [np.asarray(v).tolist(), str(np.asarray(v).dtype)]
                         for k, v in theirs.items()},
              "ours": {k: [v.tolist(), str(v.dtype), type(v).__name__] for k, v in ours.items()}}
    (out / f"rank{env.rank}.json").write_text(json.dumps(record))
    shutdown()
    if env.rank == 0:
        (out / "ended0").write_text(repr(time.time()))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
