"""Flax's IPython probes, answered without importing IPython: half a second off each rank's start.

Why: `import flax.nnx` imports IPython where it is installed (most conda environments on HPC
centres, this project's CI image): Flax asks it whether to colour its reprs and whether it runs
in a notebook (`flax.nnx.reprlib`, `flax.nnx.visualization`, `flax.nnx.summary`), and
Treescope, which Flax imports, registers its notebook display hooks with it. That costs
about 0.5 s of CPU in every process, and a job starts one process per rank. Each of these
imports takes an ImportError in its stride (no colour, no notebook hooks), and a process of
the `spmd` console script is never a notebook: there, IPython could only say it is not
running.

`install()`, called by the `spmd.cli` package before anything imports Flax, puts a finder
first on `sys.meta_path` that refuses the module `IPython` when the code importing it is in
a package of `PROBING` (the first frame outside the import machinery), so these imports take
their `ImportError` branch. Any other import of IPython, a user's task's included, gets the
real one. Nothing is installed when IPython or Flax is imported already. Imports nothing but
the standard library.
"""

from __future__ import annotations

import sys
from importlib.abc import MetaPathFinder

PROBING = ("flax", "treescope")   # packages whose imports of IPython are refused
_MACHINERY = ("importlib", "_frozen_importlib")


class FlaxIPythonProbes(MetaPathFinder):
    """Refuses `IPython` to the code of the packages in `PROBING`; other imports pass by."""

    def find_spec(self, name, path=None, target=None):
        if name != "IPython" or importer() not in PROBING:
            return None
        raise ModuleNotFoundError("IPython withheld from Flax's import-time probes "
                                  "(spmd.cli.ipython_probe)", name=name)


def importer() -> str | None:
    """The top-level package of the code that asked for the import being found."""
    frame = sys._getframe(2)
    while frame is not None:
        module = frame.f_globals.get("__name__") or ""
        if not module.startswith(_MACHINERY):
            return module.partition(".")[0]
        frame = frame.f_back
    return None


def install() -> None:
    """Put the finder first on `sys.meta_path`, unless IPython or Flax is imported already."""
    if "IPython" in sys.modules or "flax.nnx.reprlib" in sys.modules:
        return
    if not any(isinstance(f, FlaxIPythonProbes) for f in sys.meta_path):
        sys.meta_path.insert(0, FlaxIPythonProbes())
