"""Switches on the test faults (tests/helpers/fault_injection.py) in every Python started
with this folder on PYTHONPATH; `fault_injection.fault_env` puts it there.

Python imports `sitecustomize` at start-up, before the checkout is on sys.path, so the
fault-injection module is loaded by its path. The `sitecustomize` this one shadows (a
distribution's or a virtualenv's), if any, still runs afterwards.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys


def _load(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _run_shadowed() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


_HERE = os.path.dirname(os.path.abspath(__file__))
_load("_spmd_test_fault_injection",
      os.path.join(os.path.dirname(_HERE), "fault_injection.py")).install()
_run_shadowed()
