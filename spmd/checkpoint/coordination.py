"""The checkpoint's agreement among ranks: spmd.comm's Coordinator with checkpoint errors.

Every decision of a save or a restore that all ranks must share goes through a
`CheckpointCoordinator` (channels "main", "local", "persistent"): it raises
`CheckpointError`, `CheckpointTimeout` when a rank waited longer than
`checkpoint.timeout_s`, and its messages name that key. The key-value store keys stay under
`spmd/ckpt/<channel>/`.
"""

from __future__ import annotations

from spmd.checkpoint.interface import CheckpointError
from spmd.comm.agreement import Coordinator
from spmd.comm.errors import AgreementTimeout


class CheckpointTimeout(CheckpointError, AgreementTimeout):
    """A rank waited longer than checkpoint.timeout_s for others."""


class CheckpointCoordinator(Coordinator):
    """Gather-decide-broadcast for checkpoint decisions (see spmd.comm.agreement)."""

    error = CheckpointError
    timeout_error = CheckpointTimeout
    purpose = "checkpoint agreement"
    timeout_key = "checkpoint.timeout_s"
    namespace = "ckpt"
