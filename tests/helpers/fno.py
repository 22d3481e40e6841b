"""Tiny Darcy datasets and FNO configs for the operator tests (grid 16, 32 samples)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import yaml

from spmd.tasks.darcy import make_darcy_dataset

GRID = 16


def make_tiny_dataset(path: Path, grid: int = GRID, num_train: int = 32,
                      num_test: int = 8, seed: int = 0) -> Path:
    make_darcy_dataset(path, grid=grid, num_train=num_train, num_test=num_test, seed=seed,
                       solver={})
    return path


def tiny_config(tmp: Path, data_path: Path, **sections) -> Path:
    """A YAML config for a tiny FNO on `data_path`; `sections` update whole sections."""
    raw = {
        "run": {"dir": str(tmp / "run"), "log_every": 1, "progress": False},
        "model": {"name": "fno", "grid": GRID, "width": 8, "modes": 4, "num_layers": 2,
                  "projection": 16},
        "mesh": {"strategy": "dp"},
        "train": {"steps": 4, "batch_size": 8, "seed": 0, "eval_every": 2},
        "optimizer": {"lr": 3e-3},
        "data": {"source": "hdf5", "path": str(data_path), "num_train": 32, "num_test": 8,
                 "eval_batches": 1},
    }
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    path = tmp / "fno_tiny.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()
