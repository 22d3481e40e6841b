"""The checkpointer as the trainer sees it: restore once, offer every step, close."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from spmd.errors import SpmdError


class CheckpointError(SpmdError):
    """A save or restore that failed; the message names the rank(s), step and path."""


@dataclass(frozen=True)
class Restored:
    """A restored train state and where it came from ("local", "partner", "persistent")."""

    step: int
    state: Any
    source: str
    detail: str = ""
    # seconds by phase: plan_s (agreeing on step and sources), read_s (files + crc32),
    # exchange_s (pieces between ranks), h2d_s (host to device); persistent: orbax_s
    timings: dict[str, float] = field(default_factory=dict)
    # optional fields (`restore(..., optional=)`) the checkpoint did not hold: None in `state`
    missing: tuple[str, ...] = ()


class Checkpointer(Protocol):
    def restore(self, abstract_state: Any, *, optional: Sequence[str] = (),
                saves: Any = None) -> Restored | None:
        """Newest committed step across tiers, onto `abstract_state`'s shardings; None if none.

        `optional`: top-level fields of the state added after checkpoints were written without
        them; such a checkpoint restores with those fields None, named in `Restored.missing`.
        `saves`: the (abstract) state this run saves, when `abstract_state` is another form
        of it (spmd.engine.nonfinite); None: the same.
        """

    def newest_step(self) -> int | None:
        """Collective: the newest committed step of either tier (None: no checkpoint)."""

    def restore_params(self, abstract_params: Any) -> Restored | None:
        """Collective: the parameters alone of the newest committed step (`Restored.state` is
        the params tree), for checkpoint.params_only; None if there is no checkpoint."""

    def maybe_save(self, step: int, state: Any, *, force: bool = False,
                   finished: bool = False) -> None:
        """Offer the state after `step` completed steps; saves when a tier is due (or forced).

        `force`: the run stops after this step (every tier that saves periodically saves);
        `finished`: the run ends here, not preempted (checkpoint.final: the persistent tier
        commits it).
        """

    def check(self) -> None:
        """Raise an error from a background save (naming rank and path), if one happened."""

    def close(self) -> None:
        """Wait for saves in flight (bounded by checkpoint.timeout_s) and release resources."""


class NullCheckpointer:
    """Used when checkpoint.every and checkpoint.persistent_every are both 0 and
    checkpoint.final is false."""

    def restore(self, abstract_state: Any, *, optional: Sequence[str] = (),
                saves: Any = None) -> Restored | None:
        return None

    def newest_step(self) -> int | None:
        return None

    def restore_params(self, abstract_params: Any) -> Restored | None:
        return None

    def maybe_save(self, step: int, state: Any, *, force: bool = False,
                   finished: bool = False) -> None:
        return None

    def check(self) -> None:
        return None

    def close(self) -> None:
        return None
