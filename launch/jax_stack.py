"""The JAX stack installed on this node: versions, the accelerator plugin, and releases known
to be bad for spmd.

Read from the packages' metadata (`importlib.metadata`), so it costs no JAX import and starts
no backend: `spmd doctor` reports it on every rank, and the checkpointer warns once when the
release it runs on is on the list.

Invariants:
- `KNOWN_BAD` names exact releases and what goes wrong with them. pyproject.toml's pins leave
  each of them out, so only an install that went around the pins meets one: a site or
  container image with JAX preinstalled (the GPU machine spmd is checked on has jax 0.11.2),
  `pip install --no-deps`, a `--target` install. Where spmd's own code meets the fault, it
  works around it (`host_copy_blocks_donation`), and the warning still goes out.
- A PJRT plugin (`jax-cuda12-plugin`, `jax-cuda13-plugin`, `jax-rocm7-plugin` and their
  `-pjrt` halves) is built for one jaxlib: `warnings` also names every plugin whose release
  (major.minor.patch) is not jaxlib's, a mismatch that JAX reports, if at all, only when the
  backend starts.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass, field
from importlib import metadata

__all__ = ["JaxStack", "KNOWN_BAD", "host_copy_blocks_donation", "installed", "known_bad"]

# The distributions whose versions decide how a run behaves, in the order a report lists them.
PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy", "zarr", "mpi4py")

# (distribution, exact version) -> what goes wrong, and what to install instead.
KNOWN_BAD: dict[tuple[str, str], str] = {
    ("jaxlib", "0.11.2"): (
        "jaxlib 0.11.2 stops donating a buffer once it was copied to the host "
        "(copy_to_host_async, jax.device_get, np.asarray where it needs a transfer): a train "
        "step after such a copy keeps the old state alive and allocates a second one, without "
        "a warning, an out-of-memory error on a GPU whose state fills half its memory. spmd's "
        "host snapshot copies an on-device copy of each piece on this release; code of yours "
        "that copies the train state to the host does not. Install jax and jaxlib 0.12 (or "
        "0.11.1), with the plugin of the same release: docs/install.md"),
}

# jaxlib releases that keep a buffer from donation once it was copied to the host. Measured on
# CPU with 8 devices, 2026-11-29: after copy_to_host_async, and after np.asarray where that needs
# a transfer (a bfloat16 shard; on a GPU presumably every dtype, as there is no host view of
# device memory: not measured), 0 of 6 donating steps donated; after np.asarray of a fresh
# on-device copy of each shard, 4 of 4 did: what spmd's host snapshot does on these releases.
HOST_COPY_BLOCKS_DONATION = frozenset({"0.11.2"})

# PJRT plugins, by the prefix of their distribution names.
PLUGIN_PREFIXES = ("jax-cuda", "jax-rocm", "jax-tpu", "jax-metal", "libtpu")


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _release(version: str) -> tuple[str, ...]:
    """major.minor.patch of a version string ("0.12.0.1" -> ("0", "12", "0"))."""
    return tuple(version.split("+")[0].split(".")[:3])


@dataclass(frozen=True)
class JaxStack:
    """What is installed: `versions` of PACKAGES (None where absent), `plugins` (PJRT plugin
    distributions and their versions), and `warnings`: known-bad releases, and plugins built
    for another jaxlib."""

    python: str
    versions: dict[str, str | None]
    plugins: dict[str, str] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return {"python": self.python, "versions": dict(self.versions),
                "plugins": dict(self.plugins), "warnings": list(self.warnings)}


@functools.cache
def host_copy_blocks_donation() -> bool:
    """Whether this jaxlib keeps a buffer from donation once it was copied to the host
    (HOST_COPY_BLOCKS_DONATION): copy a fresh on-device copy of it instead."""
    return _version("jaxlib") in HOST_COPY_BLOCKS_DONATION


def known_bad(versions: dict[str, str | None] | None = None) -> list[str]:
    """What goes wrong with each release in `versions` (default: the installed ones) that
    KNOWN_BAD lists."""
    if versions is None:
        versions = {name: _version(name) for name, _ in KNOWN_BAD}
    return [why for (name, bad), why in KNOWN_BAD.items() if versions.get(name) == bad]


def _plugins() -> dict[str, str]:
    found: dict[str, str] = {}
    for dist in metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name.startswith(PLUGIN_PREFIXES):
            found[name] = dist.version
    return dict(sorted(found.items()))


def installed() -> JaxStack:
    """The stack of this Python, from package metadata alone."""
    versions = {name: _version(name) for name in PACKAGES}
    plugins = _plugins()
    warnings = known_bad(versions)
    jaxlib = versions.get("jaxlib")
    for name, version in plugins.items():
        if jaxlib and not name.startswith("libtpu") and _release(version) != _release(jaxlib):
            warnings.append(
                f"{name} {version} is built for jaxlib {'.'.join(_release(version))}, and "
                f"jaxlib {jaxlib} is installed: JAX may refuse the plugin or fail in it "
                f"(install one release of both, e.g. pip install 'jax[cuda13]=={jaxlib}')")
    python = ".".join(str(p) for p in sys.version_info[:3])
    return JaxStack(python, versions, plugins, tuple(warnings))
