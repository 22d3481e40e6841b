"""Each rank's compiled train step, kept beside the run, so that a new try or a resumed job
on the same layout loads it instead of compiling (issue 50: compile was about half of a
lost node's recovery).

Why not JAX's persistent compilation cache alone: it writes entries from process 0 only,
and keys a CPU executable by its process's device assignment, so on CPU every rank but 0
compiles again after every restart. Here every rank keeps its own executable
(`jax.experimental.serialize_executable`), as `<store>/<key>/rank<r>.bin`.

Invariants
- The key is a digest of everything that makes the job's executables: the lowered program's
  text (the model, the step, the shardings and donation it was lowered with, the same on
  every rank), the job's devices and the process each belongs to, the backend and its
  version, jax and jaxlib, and XLA_FLAGS. A change in any of them is a new key, so a stale
  executable is never loaded; each rank's own executable is its file in the key's folder.
- Where JAX's persistent cache serves this process (on CPU process 0 only; on GPUs every
  process), it does the job and the store stays out: an executable JAX loaded from its
  cache does not serialize whole.
- A program that calls back into Python (a host callback, an effect) is compiled and never
  kept: its executable points into the process that compiled it.
- A file that cannot be read or loaded is not an error: the step is compiled, as without a
  store, and the log says why (one WARNING line, rank and path).
- Files are written whole (spmd.atomic_write, a temporary sibling then a rename), never
  fsynced: a lost file costs one compile. Rank 0 removes the other keys' folders once it
  has written its own, so the run's store holds one layout's executables.
- Where JAX's persistent cache is on (run.compilation_cache or JAX_COMPILATION_CACHE_DIR, a
  local or mounted path), the ranks JAX's cache does not serve also keep their executables
  in its `spmd-executables` folder (`shared_store`), looked up after the run's own store:
  another run of the same program on the same devices (a sweep, a job in a new run.dir)
  loads them there, as JAX's cache serves rank 0. That folder keeps every layout, as JAX's
  cache does, and is emptied with it. The initializer goes there too (never to the run's
  store, which holds the train step: a resumed job restores, it does not initialize); the
  key holds the compiler options a program is compiled with.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import jax

from spmd.atomic_write import write_atomic

log = logging.getLogger(__name__)


def executable_key(lowered: Any, text: str | None = None,
                   compiler_options: dict[str, Any] | None = None) -> str:
    """The digest that names `lowered`'s executables (module doc); `text`: its `as_text()`,
    when the caller has it already (a large program's text takes time to render);
    `compiler_options`: those it is compiled with."""
    import jaxlib

    h = hashlib.sha256()
    backend = jax.devices()[0].client
    for part in (lowered.as_text() if text is None else text, jax.__version__, jaxlib.__version__,
                 backend.platform, backend.platform_version, os.environ.get("XLA_FLAGS", ""),
                 ",".join(f"{d.id}:{d.process_index}:{d.device_kind}" for d in jax.devices()),
                 repr(sorted((compiler_options or {}).items()))):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:24]


def calls_back_into_python(lowered: Any, text: str | None = None) -> bool:
    """Whether the program calls Python (jax.debug.callback, pure_callback, io_callback,
    effects): its executable holds pointers into this process and cannot be loaded by
    another, so it is never kept (as JAX's own cache never keeps it). `text`: as for
    `executable_key`."""
    args = getattr(getattr(lowered, "_lowering", None), "compile_args", None)
    if isinstance(args, dict) and any(args.get(k) for k in (
            "host_callbacks", "keepalive", "ordered_effects", "unordered_effects")):
        return True
    text = lowered.as_text() if text is None else text
    return "python_cpu_callback" in text or "python_gpu_callback" in text


def jax_cache_serves_this_process() -> bool:
    """Whether JAX's own persistent compilation cache is on and may hand this process its
    executables: on CPU process 0 only (the others' keys hold their device assignment, and
    only process 0 writes entries), on other backends every process. Then the store stays
    out: an executable JAX loaded from its cache does not serialize whole (XLA:CPU leaves
    its kernels out, and loading it fails at the first step)."""
    if not (jax.config.jax_enable_compilation_cache and jax.config.jax_compilation_cache_dir):
        return False
    return jax.default_backend() != "cpu" or jax.process_index() == 0


SHARED_FOLDER = "spmd-executables"


def shared_store() -> Path | None:
    """`<JAX's persistent cache dir>/spmd-executables` where that cache is on and its dir is
    a path (not a URL such as gs://); else None."""
    if not jax.config.jax_enable_compilation_cache:
        return None
    return shared_store_in(jax.config.jax_compilation_cache_dir)


def shared_store_in(cache_dir: str | None) -> Path | None:
    """The shared store in JAX's persistent cache dir `cache_dir`; None for none or a URL."""
    if not cache_dir or "://" in str(cache_dir):
        return None
    return Path(cache_dir) / SHARED_FOLDER


def compile_or_load(lowered: Any, store: Path | None, rank: int,
                    jax_cache_serves: bool | None = None, shared: Path | None = None,
                    compiler_options: dict[str, Any] | None = None) -> tuple[Any, str]:
    """`lowered` compiled (with `compiler_options`), or loaded from `store` or else from
    `shared`; and how: "loaded" or "compiled". A compiled executable is kept in both; with
    neither, it is always compiled. `store`: the run's (run.keep_executables), one layout,
    pruned by rank 0; `shared`: `shared_store()`, kept across runs (module doc).
    `jax_cache_serves` (default: `jax_cache_serves_this_process()`) leaves both out where
    JAX's cache already serves this process."""
    if jax_cache_serves is None:
        jax_cache_serves = jax_cache_serves_this_process()
    places = list(dict.fromkeys(p for p in (store, shared) if p is not None))
    if not places or jax_cache_serves:
        return lowered.compile(compiler_options=compiler_options), "compiled"
    text = lowered.as_text()
    if calls_back_into_python(lowered, text):
        return lowered.compile(compiler_options=compiler_options), "compiled"
    from jax.experimental import serialize_executable

    key = executable_key(lowered, text, compiler_options)
    paths = [place / key / f"rank{rank:05d}.bin" for place in places]
    for path in paths:
        if path.exists():
            try:
                compiled = serialize_executable.deserialize_and_load(
                    path.read_bytes(), lowered.in_tree, lowered.out_tree)
                return compiled, "loaded"
            except Exception as e:  # noqa: BLE001 - a lost cache entry costs a compile
                log.warning("rank %d: the kept executable %s did not load (%s: %s); "
                            "compiling it again", rank, path, type(e).__name__, e)
    compiled = lowered.compile(compiler_options=compiler_options)
    try:
        payload, _, _ = serialize_executable.serialize(compiled)
    except Exception as e:  # noqa: BLE001 - the run trains on; the next try compiles
        log.warning("rank %d: could not serialize the compiled program (%s: %s)", rank,
                    type(e).__name__, e)
        return compiled, "compiled"
    for path in paths:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, payload, durable=False)
        except Exception as e:  # noqa: BLE001 - the run trains on; the next try compiles
            log.warning("rank %d: could not keep the compiled program in %s (%s: %s)", rank,
                        path, type(e).__name__, e)
    if rank == 0 and store is not None and (store / key / f"rank{rank:05d}.bin").exists():
        _remove_other_keys(store, key)
    return compiled, "compiled"


def _remove_other_keys(store: Path, key: str) -> None:
    """Rank 0: the folders of other layouts (one job holds a run.dir at a time: its lease)."""
    for folder in store.iterdir():
        if folder.name != key and folder.is_dir():
            shutil.rmtree(folder, ignore_errors=True)
