"""A train state as the persistent tier's Orbax items: `params` on its own, so that the
parameters restore (and load: spmd.load, `ocp.StandardCheckpointer().restore(<step>/params,
...)`) without the optimizer state, and `train_state`, the rest.

Invariants:
- `join_state(like, split_state(state))` is `state` for a dataclass with a `params` field
  (spmd's TrainState), a dict with a "params" key, or any other pytree (saved whole as
  `train_state`); fields that are None (absent) are left out and come back None.
- `without_fields` is the state as a checkpoint written before those top-level fields
  existed holds it (restoring such a checkpoint onto a newer state).
- Checkpoints of earlier versions hold one item, `default` (LEGACY_ITEM), the whole state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

PARAMS, TRAIN_STATE, LEGACY_ITEM = "params", "train_state", "default"


def split_state(state: Any) -> dict[str, Any]:
    """The Orbax items of a state: {"params": its `params`, "train_state": the rest}.

    A state with a `params` field (a dataclass such as spmd's TrainState) or key (a dict)
    is split; any other pytree is saved whole as "train_state".
    Fields that are None (absent: see `without_fields`) are left out.
    """
    if dataclasses.is_dataclass(state) and hasattr(state, "params"):
        rest = {f.name: getattr(state, f.name) for f in dataclasses.fields(state)
                if f.name != "params" and getattr(state, f.name) is not None}
        return {PARAMS: state.params, TRAIN_STATE: rest}
    if isinstance(state, Mapping) and "params" in state:
        return {PARAMS: state["params"],
                TRAIN_STATE: {k: v for k, v in state.items()
                              if k != "params" and v is not None}}
    return {TRAIN_STATE: state}


def present_fields(state: Any) -> dict[str, Any] | None:
    """A dataclass state's fields that are not None, as a dict (None: not a dataclass)."""
    if not dataclasses.is_dataclass(state):
        return None
    return {f.name: getattr(state, f.name) for f in dataclasses.fields(state)
            if getattr(state, f.name) is not None}


def without_fields(state: Any, names: Sequence[str]) -> Any:
    """`state` with the top-level fields `names` set to None (a dataclass) or dropped (a
    dict): the state as a checkpoint written before those fields existed holds it."""
    if not names:
        return state
    if dataclasses.is_dataclass(state):
        return dataclasses.replace(state, **{n: None for n in names})
    if isinstance(state, Mapping):
        return {k: v for k, v in state.items() if k not in names}
    return state


def join_state(like: Any, items: Mapping[str, Any]) -> Any:
    """Inverse of `split_state`, shaped like `like` (the abstract state restored onto)."""
    if PARAMS not in items:
        return items[TRAIN_STATE]
    if dataclasses.is_dataclass(like):
        return dataclasses.replace(like, params=items[PARAMS], **items[TRAIN_STATE])
    return {PARAMS: items[PARAMS], **items[TRAIN_STATE]}
