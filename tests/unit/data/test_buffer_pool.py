"""spmd.data.buffer_pool: batch buffers are used again only once nothing refers to them
(not even an array XLA built on one without a copy), aligned, and the pool keeps no more
unused memory than its `spare`."""

from __future__ import annotations

import gc

import jax
import numpy as np

from spmd.data.buffer_pool import BufferPool


def address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def test_a_buffer_in_use_is_never_handed_out_and_a_released_one_is():
    pool = BufferPool()
    a = pool.empty((8, 16), np.float32)
    b = pool.empty((8, 16), np.float32)
    assert address(a) != address(b)
    assert a.flags.c_contiguous and a.shape == (8, 16) and a.dtype == np.float32
    assert address(a) % 64 == 0 and address(b) % 64 == 0
    view = a[2:4]                                  # a view keeps the buffer in use
    at = address(a)
    del a
    c = pool.empty((8, 16), np.float32)
    assert address(c) not in (at, address(b))
    del view
    d = pool.empty((4, 32), np.float32)            # same bytes, another shape: reused
    assert address(d) == at and d.shape == (4, 32)
    assert (pool.made, pool.reused) == (3, 1)


def test_an_array_xla_aliases_keeps_its_buffer_until_it_is_gone():
    pool = BufferPool()
    host = pool.empty((32, 64), np.float32)
    host[...] = np.arange(32 * 64, dtype=np.float32).reshape(32, 64)
    on_device = jax.device_put(host, jax.devices()[0])
    at = address(host)
    assert on_device.unsafe_buffer_pointer() == at          # XLA took it without a copy
    del host
    gc.collect()
    other = pool.empty((32, 64), np.float32)
    other[...] = -1                                # must not reach the device array
    np.testing.assert_array_equal(np.asarray(on_device),
                                  np.arange(32 * 64, dtype=np.float32).reshape(32, 64))
    del on_device, other
    gc.collect()
    again = [pool.empty((32, 64), np.float32) for _ in range(2)]
    assert at in {address(a) for a in again}      # both released: both reused


def test_unused_buffers_beyond_spare_are_let_go():
    pool = BufferPool(spare=1)
    held = [pool.empty((1024,), np.uint8) for _ in range(5)]
    del held
    pool.empty((1024,), np.uint8)                  # one in use, one spare kept
    assert len(pool._owners[1024]) == 2
    assert pool.made == 5
