"""The `spmd` console script: a thin caller of the library, one module per subcommand.

Owns: argument parsing (`main`) and the subcommands (`<name>_cmd`). May import every layer;
nothing imports it.
"""

from spmd.cli.main import main

__all__ = ["main"]
