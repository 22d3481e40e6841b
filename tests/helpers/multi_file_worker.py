"""One rank of the multi-file feed test: global batches from a multi-file dataset.

    mpiexec -n 2 python tests/helpers/multi_file_worker.py SINGLE.h5 H5_DIR ZARR_DIR OUT_DIR

For each multi-file dataset (an HDF5 directory and a Zarr directory, indexed beforehand)
and mesh (`dp`: each rank its rows; `spatial`: each rank its slab of every row), the
rank builds BatchFeed global batches (prefetch on) and compares their gathered values with
the single file's rows. OUT_DIR/rank<R>.json records the comparisons, the files each
source opened (and every store this process opened), the files its rows are in and the
bytes read.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

BATCH, GRID, STEPS = 8, 16, (0, 1, 2)


def main(single: Path, h5: Path, zarr: Path, out: Path) -> None:
    from spmd.launch import bootstrap

    env = bootstrap()
    import jax

    from spmd.comm.host_gather import gather_to_host
    from spmd.config.schema import MeshConfig
    from spmd.data import ArraySource, BatchField
    from spmd.data.formats import stores
    from spmd.data.loader.feed import BatchFeed
    from spmd.engine.mesh import build_mesh
    from spmd.sharding import rules_for

    fields = {"f": BatchField((GRID, GRID, 1), np.float32, ("batch", "x", "y", None))}
    reference = ArraySource(single, {"f": "train/f"}, fields, BATCH, seed=3)
    want = {s: reference.rows(s, 0, BATCH)["f"] for s in STEPS}
    record: dict = {"rank": env.rank}
    for strategy, axes in (("dp", {}), ("spatial", {"context": 4, "tensor": 2})):
        mesh = build_mesh(MeshConfig(strategy=strategy, axes=axes), jax.devices(),
                          env.node_of_rank)
        feed = BatchFeed(fields, BATCH, mesh, rules_for(strategy))
        for fmt, path in (("hdf5", h5), ("zarr", zarr)):
            stores.OPENED.clear()
            src = ArraySource(path, {"f": "train/f"}, fields, BATCH, seed=3, prefetch=2,
                              read_threads=2, prefetch_until=max(STEPS) + 1)
            equal = []
            for step in STEPS:
                batch = feed.global_batch(src, step)
                got = gather_to_host(batch["f"])
                equal.append(bool(np.array_equal(got, want[step])))
            feed.close()
            rows = feed.ranges["f"]
            needed = sorted({f for s in STEPS for f in src.files_for(s, *rows)})
            record[f"{strategy}/{fmt}"] = {
                "equal": equal, "rows": list(rows), "opened": sorted(set(src.opened_files)),
                "all_opened": sorted(stores.OPENED), "needed": needed,
                "bytes": src.bytes_read, "records": src.records_read,
            }
    (out / f"rank{env.rank}.json").write_text(json.dumps(record))
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(*(Path(a) for a in sys.argv[1:5]))
