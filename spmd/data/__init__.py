"""Data: deterministic sources and the feed that assembles global batches.

The public names for a user's task load lazily (no h5py/grain import until used):
`BatchField`, `DataSource`, and the on-disk array source `ArraySource` with its writer
`write_arrays` and its error `ArrayDataError` (spmd.data.arrays).
"""

from __future__ import annotations

import importlib
from typing import Any

_PUBLIC = {
    "BatchField": "spmd.data.batch",
    "DataSource": "spmd.data.batch",
    "ArraySource": "spmd.data.arrays",
    "ArrayDataError": "spmd.data.arrays",
    "write_arrays": "spmd.data.arrays",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'spmd.data' has no attribute '{name}'")
    return getattr(importlib.import_module(module), name)
