"""The `spmd` console script: a thin caller of the library, one module per subcommand.

Owns: argument parsing (`main`) and the subcommands (`<name>_cmd`). May import every layer;
nothing imports it.
"""

from spmd.cli import ipython_probe
from spmd.cli.early_signal import catch

catch()  # `spmd run` / `spmd train`: a preemption signal from the first moment is recorded
ipython_probe.install()  # before Flax: its colour probe need not import IPython (0.5 s a rank)

from spmd.cli.main import main  # noqa: E402

__all__ = ["main"]
