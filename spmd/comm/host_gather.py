"""Every rank gets whole arrays as numpy, and no part of the gather is left running.

`gather_to_host` is `jax.experimental.multihost_utils.process_allgather(tree, tiled=True)`,
and `sync_devices` its `sync_global_devices`, with one difference that matters at the end of
a job. JAX's version replicates the array with a device collective and reads local device
0's copy; the collective on the other local devices may still be running when it returns,
and nothing waits for it. If a rank then ends, a peer whose own part is still connecting to
it (Gloo on CPU) is held in its exit, by the XLA client's destructor, until Gloo gives up:
about 150 s, seen as a 2-rank job that wrote its result and then took minutes to end. Here
the gather returns only once every local device's part is done, so a rank that returns has
nothing left in flight.
"""

from __future__ import annotations

import zlib
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec


def _identity(x: Any) -> Any:
    return x


def _replicated(x: jax.Array) -> jax.Array:
    """x (a NamedSharding array) replicated on its mesh; every local copy computed."""
    out = jax.jit(_identity, out_shardings=x.sharding.update(spec=PartitionSpec()))(x)
    return out.block_until_ready()   # every local device's part, not only device 0's


def _gather_one(x: Any) -> np.ndarray:
    if jax.process_count() == 1:
        return np.asarray(x)
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        if not isinstance(x.sharding, NamedSharding):  # not made by jax's public API
            return multihost_utils.process_allgather(x, tiled=True)
        return np.asarray(_replicated(x).addressable_data(0))
    local = np.asarray(x)   # this rank's own part: concatenated along axis 0 (0-d: stacked)
    if local.ndim == 0:
        local = local[None]
    devices = np.array(jax.devices()).reshape(jax.process_count(), jax.local_device_count())
    by_process = NamedSharding(Mesh(devices, ("processes", "local_devices")),
                               PartitionSpec("processes"))
    shape = (local.shape[0] * jax.process_count(), *local.shape[1:])
    with jax.set_mesh(by_process.mesh):   # whatever mesh the caller has set
        spread = jax.make_array_from_process_local_data(by_process, local, shape)
        return np.asarray(_replicated(spread).addressable_data(0))


def gather_to_host(tree: Any) -> Any:
    """Each leaf whole on every rank, as numpy: a global array's full value, or every rank's
    host array concatenated along axis 0 in rank order (a 0-d one stacked). A collective:
    every rank calls it with the same tree."""
    return jax.tree.map(_gather_one, tree)


def sync_devices(name: str) -> None:
    """A barrier of every device of every rank (`multihost_utils.sync_global_devices`: a
    device collective, which also sets up the collectives' connections), that returns only
    once this rank's part is done. Every rank calls it with the same `name`."""
    mine = np.uint32(zlib.crc32(name.encode()))
    every = gather_to_host(mine)
    if not (every == mine).all():
        raise RuntimeError(f"sync_devices({name!r}): the ranks passed different names "
                           f"(crc32 per rank: {every.tolist()})")
