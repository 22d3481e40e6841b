"""The vocabulary: mesh axis names (hardware) and logical axis names (models)."""

from __future__ import annotations

# Mesh axes, slowest network first: inter-node factors land on the outer ones.
MESH_AXES: tuple[str, ...] = ("data", "stage", "fsdp", "context", "tensor", "expert")

# Logical names the reference models use. Rule tables may add more.
LOGICAL_AXES: tuple[str, ...] = (
    "batch", "length", "embed", "mlp", "heads", "kv", "vocab", "layers",
    "x", "y", "z", "channels", "modes",
)

# Activation rules are looked up under this prefix first, then the plain name.
ACTIVATION_PREFIX = "activation_"

# Mesh axes that parameters may be split over (data and context split only batches and
# sequences): a parameter left whole while one of them is larger than 1 is replicated there.
PARAM_MESH_AXES: tuple[str, ...] = ("stage", "fsdp", "tensor", "expert")
