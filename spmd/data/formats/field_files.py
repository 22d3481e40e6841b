"""Field datasets on disk: one HDF5 file with `train` and `test` groups.

Layout (format version 1):

    /                 attrs: format, version, pde, grid, seed, num_train, num_test,
                             in_channels, out_channels, solver, solver_params (JSON)
    /train/a, /train/u   (num_train, grid, grid) float32, one chunk per sample
    /train            attrs: a_mean, a_std, u_mean, u_std (float64, over the train split)
    /test/a, /test/u     (num_test, grid, grid) float32

Inputs `a` and outputs `u` may also carry a trailing channel dimension. The file is
written to a temporary name in the same directory and renamed when complete, so a
killed writer never leaves a half file at the final path.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from spmd.atomic_write import atomic_path
from spmd.errors import SpmdError

log = logging.getLogger("spmd.data")

FORMAT = "spmd-fields"
VERSION = 1
SPLITS = ("train", "test")
FIELDS = ("a", "u")


class DatasetError(SpmdError):
    """A dataset file that does not exist, is not ours, or does not fit the config."""


@dataclass(frozen=True)
class FieldStats:
    """Scalar mean and standard deviation of one field over the train split."""

    mean: float
    std: float


@dataclass(frozen=True)
class FieldsInfo:
    """What a validated file holds."""

    path: Path
    grid: int
    counts: dict[str, int]
    channels: dict[str, int]            # field -> channels (1 for a 3-D dataset)
    attrs: dict[str, Any]


# ---------------------------------------------------------------- writing


SampleFn = Callable[[int, int], tuple[np.ndarray, np.ndarray]]   # (split id, index) -> (a, u)


def _chunks(split_id: int, count: int, size: int) -> Iterator[tuple[int, int, int]]:
    for start in range(0, count, size):
        yield split_id, start, min(start + size, count)


def _solve_chunk(job: tuple[SampleFn, int, int, int]) -> tuple[np.ndarray, np.ndarray]:
    fn, split_id, start, stop = job
    pairs = [fn(split_id, i) for i in range(start, stop)]
    return np.stack([p[0] for p in pairs]), np.stack([p[1] for p in pairs])


def available_cpus(limit: int = 16) -> int:
    """The CPUs this process may run on (its affinity: a scheduler's --cpus-per-task), at
    most `limit`: how many solver threads a rank that makes a dataset runs while the other
    ranks wait for it."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:      # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, limit))


def write_fields(path: Path, sample_fn: SampleFn, grid: int, counts: dict[str, int],
                 attrs: dict[str, Any], *, workers: int = 1, in_threads: bool = False,
                 compression: str | None = None,
                 progress: Callable[[int, int], None] | None = None) -> FieldsInfo:
    """Generate every sample with `sample_fn` and write the file atomically (tmp + rename).

    `sample_fn` must be picklable when `workers > 1` (a module-level function or partial).
    `in_threads`: the workers are threads of this process, not processes (a rank whose JAX
    runtime and coordination client already run threads must not fork; the sparse solves
    release the GIL). The file is the same for any number of workers, threads or processes
    (each sample has its own generator; the chunks are written in order).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    total, done = sum(counts.values()), 0
    jobs = [(sample_fn, *c) for sid, split in enumerate(SPLITS)
            for c in _chunks(sid, counts[split], 16)]
    pool: Executor | None = None
    if workers > 1:
        pool = ThreadPoolExecutor(workers) if in_threads else ProcessPoolExecutor(workers)
    try:
        results = pool.map(_solve_chunk, jobs) if pool else map(_solve_chunk, jobs)
        with atomic_path(path, durable=True) as tmp, h5py.File(tmp, "w") as f:
            f.attrs.update({"format": FORMAT, "version": VERSION, "grid": grid,
                            "in_channels": 1, "out_channels": 1,
                            **{f"num_{s}": counts[s] for s in SPLITS}, **attrs})
            sums: dict[str, np.ndarray] = {k: np.zeros(2) for k in FIELDS}
            for (_, split_id, start, stop), (a, u) in zip(jobs, results):
                split = SPLITS[split_id]
                group = f.require_group(split)
                for name, values in (("a", a), ("u", u)):
                    if name not in group:
                        group.create_dataset(
                            name, (counts[split], grid, grid), dtype=np.float32,
                            chunks=(1, grid, grid), compression=compression,
                        )
                    group[name][start:stop] = values.astype(np.float32)
                    if split == "train":
                        v = values.astype(np.float32).astype(np.float64)
                        sums[name] += (v.sum(), (v * v).sum())
                done += stop - start
                if progress is not None:
                    progress(done, total)
            n = counts["train"] * grid * grid
            for name, (s1, s2) in sums.items():
                mean = s1 / n
                f["train"].attrs[f"{name}_mean"] = mean
                f["train"].attrs[f"{name}_std"] = np.sqrt(max(s2 / n - mean * mean, 0.0))
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    return inspect_fields(path)


# ---------------------------------------------------------------- reading


def open_h5(path: Path) -> h5py.File:
    """Read-only; retried without HDF5 file locking where the file system refuses locks
    (common on parallel file systems without flock)."""
    try:
        return h5py.File(path, "r")
    except OSError as e:
        if "lock" not in str(e).lower():
            raise
        return h5py.File(path, "r", locking=False)


def inspect_fields(path: Path) -> FieldsInfo:
    """Open and check the structure of a fields file; errors name the file and what is wrong."""
    path = Path(path)
    where = f"data.path={path}"
    if not path.is_file():
        raise DatasetError(
            f"{where}: no such file on this host (make it with `spmd data make CONFIG`; with "
            f"several nodes data.path must be on a file system that every rank sees)"
        )
    if not h5py.is_hdf5(path):
        raise DatasetError(
            f"{where}: not an HDF5 file; point data.path at a dataset made by "
            f"`spmd data make CONFIG` or at a new path (the file was left unchanged)"
        )
    try:
        with open_h5(path) as f:
            attrs = {k: _plain(v) for k, v in f.attrs.items()}
            if attrs.get("format") != FORMAT:
                raise DatasetError(
                    f"{where}: HDF5 attribute 'format' is {attrs.get('format')!r}, expected "
                    f"{FORMAT!r}; this file was not made by `spmd data make` (left unchanged)"
                )
            counts, channels, grids = {}, {}, set()
            for split in SPLITS:
                for name in FIELDS:
                    key = f"{split}/{name}"
                    if key not in f or not isinstance(f[key], h5py.Dataset):
                        raise DatasetError(f"{where}: HDF5 dataset '{key}' is missing")
                    shape = f[key].shape
                    if len(shape) not in (3, 4) or shape[1] != shape[2]:
                        raise DatasetError(
                            f"{where}: HDF5 dataset '{key}' has shape {shape}; expected "
                            f"(samples, grid, grid) or (samples, grid, grid, channels)"
                        )
                    grids.add(shape[1])
                    counts.setdefault(split, shape[0])
                    if counts[split] != shape[0]:
                        raise DatasetError(
                            f"{where}: '{split}/a' and '{split}/u' hold different sample counts"
                        )
                    ch = shape[3] if len(shape) == 4 else 1
                    if channels.setdefault(name, ch) != ch:
                        raise DatasetError(f"{where}: '{key}' has {ch} channels, other splits "
                                           f"{channels[name]}")
    except (OSError, KeyError, RuntimeError) as e:  # h5py: KeyError for a damaged header
        raise DatasetError(f"{where}: cannot read the HDF5 file ({type(e).__name__}: {e}); it "
                           f"may be truncated or corrupt: make it again with `spmd data make "
                           f"CONFIG --force` (left unchanged)") from None
    if len(grids) != 1 or attrs.get("grid") not in grids:
        raise DatasetError(
            f"{where}: HDF5 attribute 'grid'={attrs.get('grid')} does not match the dataset "
            f"shapes (grids {sorted(grids)}); the file is inconsistent"
        )
    return FieldsInfo(path, int(attrs["grid"]), counts, channels, attrs)


def _plain(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, np.generic):
        return value.item()
    return value


def check_fields(info: FieldsInfo, *, grid: int, in_channels: int, out_channels: int,
                 num_train: int, num_test: int) -> None:
    """Refuse a file that does not fit the config, naming file, attribute and config key."""
    where = f"data.path={info.path}"
    keep = "(the file was left unchanged)"
    if info.grid != grid:
        raise DatasetError(
            f"{where}: HDF5 attribute 'grid'={info.grid} but model.grid={grid}; set "
            f"model.grid={info.grid} or point data.path at another file {keep}"
        )
    for name, key, want in (("a", "in_channels", in_channels), ("u", "out_channels",
                                                                 out_channels)):
        have = info.channels[name]
        if have != want:
            raise DatasetError(
                f"{where}: field '{name}' has {have} channel(s) (HDF5 attribute "
                f"'{key}'={info.attrs.get(key, have)}) but model.{key}={want}; set "
                f"model.{key}={have} or point data.path at another file {keep}"
            )
    for split, want in (("train", num_train), ("test", num_test)):
        if info.counts[split] < want:
            raise DatasetError(
                f"{where}: split '{split}' holds {info.counts[split]} samples (HDF5 attribute "
                f"'num_{split}') but data.num_{split}={want}; lower data.num_{split} or make "
                f"a larger file {keep}"
            )


def field_stats(info: FieldsInfo, num_train: int) -> dict[str, FieldStats]:
    """Per-field scalar mean/std over the first `num_train` train samples (float64, exact order)."""
    with open_h5(info.path) as f:
        group = f["train"]
        if num_train == info.counts["train"] and all(
                f"{k}_mean" in group.attrs for k in FIELDS):
            return {k: FieldStats(float(group.attrs[f"{k}_mean"]), float(group.attrs[f"{k}_std"]))
                    for k in FIELDS}
        out = {}
        for k in FIELDS:
            s1 = s2 = 0.0
            n = 0
            for start in range(0, num_train, 64):
                v = group[k][start:min(start + 64, num_train)].astype(np.float64)
                s1, s2, n = s1 + v.sum(), s2 + (v * v).sum(), n + v.size
            mean = s1 / n
            out[k] = FieldStats(mean, float(np.sqrt(max(s2 / n - mean * mean, 0.0))))
        return out


def describe(info: FieldsInfo) -> str:
    counts = ", ".join(f"{s} {n}" for s, n in info.counts.items())
    return f"{info.path}: grid {info.grid}, {counts}, solver {info.attrs.get('solver')}"


def solver_attrs(name: str, params: dict[str, Any]) -> dict[str, Any]:
    return {"solver": name, "solver_params": json.dumps(params, sort_keys=True)}
