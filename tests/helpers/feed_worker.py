"""One rank of the slab-feed test: feeds a spatially split batch from an HDF5 file twice.

    mpiexec -n 2 python tests/helpers/feed_worker.py DATA.h5 OUT_DIR

Under `spatial` (x over context, y over tensor) each rank builds BatchFeed global batches
from (1) the ArraySource, which reads only this rank's slab, and (2) a wrapper without
slab support (whole examples, the feed's old path). Both are gathered and compared with
the file; OUT_DIR/rank<R>.json records the region, bytes read and the comparisons.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

BATCH, GRID = 4, 16


class WholeExamples:
    """A source without `reads_slabs`: the feed asks it for whole examples."""

    def __init__(self, inner):
        self.inner = inner

    def rows(self, step, start, stop):
        return self.inner.rows(step, start, stop)


def main(data: Path, out: Path) -> None:
    from spmd.launch import bootstrap

    env = bootstrap()
    import jax

    from spmd.comm.host_gather import gather_to_host
    from spmd.config.schema import MeshConfig
    from spmd.data import ArraySource, BatchField
    from spmd.data.loader.feed import BatchFeed
    from spmd.engine.mesh import build_mesh
    from spmd.sharding import rules_for

    mesh = build_mesh(MeshConfig(strategy="spatial", axes={"context": 4, "tensor": 2}),
                      jax.devices(), env.node_of_rank)
    fields = {"f": BatchField((GRID, GRID, 1), np.float32, ("batch", "x", "y", None))}
    feed = BatchFeed(fields, BATCH, mesh, rules_for("spatial"))
    slab = ArraySource(data, {"f": "train/f"}, fields, BATCH, seed=3)
    whole = ArraySource(data, {"f": "train/f"}, fields, BATCH, seed=3)
    reference = ArraySource(data, {"f": "train/f"}, fields, BATCH, seed=3)
    record: dict = {"rank": env.rank, "region": feed.regions["f"], "rows": feed.ranges["f"]}
    for name, source in (("slab", slab), ("whole", WholeExamples(whole))):
        equal = []
        for step in (0, 5):
            batch = feed.global_batch(source, step)
            got = gather_to_host(batch["f"])
            equal.append(bool(np.array_equal(got, reference.rows(step, 0, BATCH)["f"])))
        record[f"{name}_equal"] = equal
    record["slab_bytes"], record["whole_bytes"] = slab.bytes_read, whole.bytes_read
    record["slab_reads"] = [[n, r, [[s.start, s.stop] for s in idx]]
                            for n, r, idx in slab.last_reads]
    (out / f"rank{env.rank}.json").write_text(json.dumps(record))
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
