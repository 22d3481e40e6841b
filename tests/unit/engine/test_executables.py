"""spmd.engine.executables: each rank's compiled step is kept beside the run and loaded by the
next try of the same program on the same devices, never by another program; a file that
does not load costs a compile, not the run."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from spmd.engine.executables import (
    SHARED_FOLDER,
    compile_or_load,
    executable_key,
    jax_cache_serves_this_process,
    shared_store,
    shared_store_in,
)


def lowered_step(width: int = 64, scale: float = 2.0):
    mesh = jax.make_mesh((8,), ("data",))
    sharding = NamedSharding(mesh, P("data"))
    x = jax.device_put(jnp.arange(width, dtype=jnp.float32), sharding)
    step = jax.jit(lambda v: (jnp.sin(v) * scale, (v ** 2).sum()), in_shardings=sharding,
                   donate_argnums=())
    return step.lower(x), x


def test_the_second_try_loads_the_same_executable_and_computes_the_same_bits(tmp_path):
    lowered, x = lowered_step()
    first, how = compile_or_load(lowered, tmp_path, rank=0, jax_cache_serves=False)
    assert how == "compiled"
    kept = tmp_path / executable_key(lowered) / "rank00000.bin"
    assert kept.stat().st_size > 0
    again, how = compile_or_load(lowered_step()[0], tmp_path, rank=0, jax_cache_serves=False)
    assert how == "loaded"
    for a, b in zip(first(x), again(x)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert again(x)[0].sharding == first(x)[0].sharding


def test_another_program_gets_its_own_key_and_rank_0_keeps_only_its_layout(tmp_path):
    lowered, _ = lowered_step()
    compile_or_load(lowered, tmp_path, rank=0, jax_cache_serves=False)
    other, _ = lowered_step(scale=3.0)           # another constant: another program
    assert executable_key(other) != executable_key(lowered)
    _, how = compile_or_load(other, tmp_path, rank=0, jax_cache_serves=False)
    assert how == "compiled"
    assert [p.name for p in tmp_path.iterdir()] == [executable_key(other)]


def test_another_run_of_the_same_program_loads_it_from_the_shared_store(tmp_path):
    """A rank JAX's cache does not serve (CPU process 3) keeps its step in the run's store
    and in the shared one; a run in another run.dir loads it from the shared one, computing
    the same bits. The shared store keeps every layout, even when rank 0 writes another."""
    shared = tmp_path / "jax-cache" / SHARED_FOLDER
    lowered, x = lowered_step(scale=5.0)     # a program the test process's JAX cache lacks
    first, how = compile_or_load(lowered, tmp_path / "run1", rank=3, jax_cache_serves=False,
                                 shared=shared)
    assert how == "compiled"
    key = executable_key(lowered)
    assert (tmp_path / "run1" / key / "rank00003.bin").is_file()
    assert (shared / key / "rank00003.bin").is_file()
    again, how = compile_or_load(lowered_step(scale=5.0)[0], tmp_path / "run2", rank=3,
                                 jax_cache_serves=False, shared=shared)
    assert how == "loaded"
    for a, b in zip(first(x), again(x)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    other, _ = lowered_step(scale=6.0)
    compile_or_load(other, tmp_path / "run2", rank=0, jax_cache_serves=False, shared=shared)
    assert sorted(p.name for p in shared.iterdir()) == sorted([key, executable_key(other)])
    assert [p.name for p in (tmp_path / "run2").iterdir()] == [executable_key(other)]


def test_the_compiler_options_are_in_the_key_and_a_shared_store_alone_serves(tmp_path):
    """The initializer's way: no run store, the shared one only, compiled at LLVM level 1."""
    level_1 = {"xla_backend_optimization_level": 1}
    lowered, x = lowered_step(scale=7.0)
    assert executable_key(lowered, compiler_options=level_1) != executable_key(lowered)
    first, how = compile_or_load(lowered, None, rank=1, jax_cache_serves=False,
                                 shared=tmp_path, compiler_options=level_1)
    assert how == "compiled"
    assert [p.name for p in tmp_path.iterdir()] == [executable_key(lowered,
                                                                   compiler_options=level_1)]
    again, how = compile_or_load(lowered_step(scale=7.0)[0], None, rank=1,
                                 jax_cache_serves=False, shared=tmp_path,
                                 compiler_options=level_1)
    assert how == "loaded"
    assert float(again(x)[1]) == float(first(x)[1])


def test_the_shared_store_is_in_jax_s_cache_dir_and_only_at_a_path(tmp_path):
    """The tests' processes have JAX's persistent cache on (tests.helpers.env)."""
    assert shared_store() == Path(os.environ["JAX_COMPILATION_CACHE_DIR"]) / SHARED_FOLDER
    assert shared_store_in(str(tmp_path)) == tmp_path / SHARED_FOLDER
    assert shared_store_in("gs://bucket/cache") is None
    assert shared_store_in(None) is None and shared_store_in("") is None


def test_a_damaged_file_is_compiled_again_with_a_warning_naming_rank_and_path(tmp_path,
                                                                              caplog):
    lowered, x = lowered_step()
    compile_or_load(lowered, tmp_path, rank=3, jax_cache_serves=False)
    kept = tmp_path / executable_key(lowered) / "rank00003.bin"
    kept.write_bytes(b"not an executable")
    with caplog.at_level(logging.WARNING, logger="spmd.engine.executables"):
        compiled, how = compile_or_load(lowered, tmp_path, rank=3, jax_cache_serves=False)
    assert how == "compiled"
    assert f"rank 3: the kept executable {kept} did not load" in caplog.text
    assert float(compiled(x)[1]) == float((np.arange(64, dtype=np.float32) ** 2).sum())
    again = compile_or_load(lowered, tmp_path, rank=3, jax_cache_serves=False)
    assert again[1] == "loaded"        # written again


def test_without_a_store_it_compiles_and_writes_nothing(tmp_path):
    lowered, _ = lowered_step()
    assert compile_or_load(lowered, None, rank=0)[1] == "compiled"
    assert list(tmp_path.iterdir()) == []


def test_where_jax_cache_serves_this_process_the_store_stays_out(tmp_path):
    """The tests' process has JAX's persistent cache on (tests.helpers.env) and is process 0
    on CPU: JAX's cache serves it, so nothing is kept (a JAX-loaded executable does not
    serialize whole); a program that calls back into Python is never kept either."""
    assert jax_cache_serves_this_process()
    lowered, _ = lowered_step()
    assert compile_or_load(lowered, tmp_path, rank=0)[1] == "compiled"

    def calls_back(v):
        jax.debug.callback(lambda _: None, v)
        return v + 1

    with_callback = jax.jit(calls_back).lower(jnp.ones(4))
    assert compile_or_load(with_callback, tmp_path, rank=0, jax_cache_serves=False)[1] == (
        "compiled")
    assert list(tmp_path.iterdir()) == []
