"""Using a trained run: load its model, evaluate it, predict with it, export it.

Owns `spmd.load` and the `Trained` it returns (`loading`), evaluation of a split with the
trained parameters (`evaluation`), batched and autoregressive prediction over a data file
(`prediction`), written to an HDF5 file or a Zarr store (`outputs`), and the StableHLO
export (`exporting`). May import `spmd.checkpoint` (the parameters reader), `spmd.engine`,
`spmd.loop` (the evaluation the trainer runs, so that `spmd eval` reproduces it),
`spmd.config`, `spmd.tasks`, `spmd.data`, `spmd.sharding`, `spmd.launch` and
`spmd.errors`; the CLI and the public API import it.
"""

from __future__ import annotations

from spmd.inference.loading import Trained, load, run_mesh, single_device_mesh

__all__ = ["Trained", "load", "run_mesh", "single_device_mesh"]
