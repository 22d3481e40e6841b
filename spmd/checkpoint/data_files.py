"""How large the persistent tier's data files are: several per save, written at once.

Orbax hands TensorStore's OCDBT driver a target data-file size (`ocdbt_target_data_file_size`);
left unset, a process's share of a 256 MiB state went into two files (64 and 192 MiB),
written and fsynced one after the other. Split into about `FILES_PER_SAVE` files, the same
bytes are written and fsynced in parallel: on this project's test VM the same Orbax save
took 0.17-0.19 s instead of 0.21-0.22 s (medians of 12 interleaved pairs at 16, 32 and 64
MiB; benchmarks/results/LOG.md), and its slowest repetitions halved. The size is bounded below
(`MIN_FILE_BYTES`: no swarm of tiny files for a small model) and above (`MAX_FILE_BYTES`,
Orbax's own default of 2 GiB: a large state still makes files a parallel file system
handles well); `checkpoint.persistent_file_mb` sets it outright.
"""

from __future__ import annotations

from typing import Any

import numpy as np

FILES_PER_SAVE = 8
MIN_FILE_BYTES = 16 << 20
MAX_FILE_BYTES = 2 << 30


def share_of_state(tree: Any) -> int:
    """The bytes of `tree` per process: its arrays' whole sizes (each replica counted once)
    over the process count. The same number on every process, with no communication: the
    target size must be the same everywhere, since Orbax also derives each array's chunk
    shape from it, and every process must write an array in the same chunks."""
    import jax

    total = 0
    for leaf in jax.tree.leaves(tree):
        nbytes = getattr(leaf, "nbytes", None)   # a global array's: its whole size
        total += int(nbytes if nbytes is not None else np.asarray(leaf).nbytes)
    return total // jax.process_count()


def target_file_bytes(share_bytes: int, configured_mb: int | None = None) -> int:
    """The data-file size to ask OCDBT for: `configured_mb` MiB when set, else a process's
    share of the state (`share_of_state`) over FILES_PER_SAVE, within [MIN_FILE_BYTES,
    MAX_FILE_BYTES]."""
    if configured_mb is not None:
        return int(configured_mb) << 20
    return min(max(share_bytes // FILES_PER_SAVE, MIN_FILE_BYTES), MAX_FILE_BYTES)
