"""N CPU devices standing in for N accelerators, to lay out and compile a job ahead of time."""

from __future__ import annotations

import os
import sys

from spmd.errors import SpmdError


def cpu_stand_in_devices(n: int) -> list:
    """N CPU devices for this process (set before JAX starts its backends); `--devices N`."""
    if n < 1:
        raise SpmdError(f"--devices {n}: must be at least 1")
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["JAX_NUM_CPU_DEVICES"] = str(n)
    if "jax" in sys.modules:   # imported already (e.g. in-process): configure it directly
        import jax

        try:
            jax.config.update("jax_platforms", "cpu")
            jax.config.update("jax_num_cpu_devices", n)
        except RuntimeError:
            pass  # backends already up: checked below against the devices that exist
    import jax

    devices = jax.devices()
    if len(devices) < n:
        raise SpmdError(f"--devices {n}: this process already runs JAX with {len(devices)} "
                        f"devices; run the command in a fresh process")
    return devices[:n]
