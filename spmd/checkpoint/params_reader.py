"""The parameters alone, from either tier, onto any devices: what `spmd.load` reads.

Training restores the whole state onto the run's own mesh (spmd.checkpoint.restore). Using a
trained model needs less and more: the parameters only (no optimizer state is read from
disk), onto whatever devices are at hand (one CPU device in a notebook, or the run's mesh).

- Persistent tier: the step's `params` Orbax item, read by Orbax onto the target shardings
  (steps written before the items were split hold one `default` item; their `params`
  subtree is read alone). The files read are first checked against the step's manifest.
- Local tier: every rank's packed blob (its own directory, else a partner's copy) is read on
  the host, crc-checked piece by piece, and the `params/...` pieces are assembled into whole
  arrays, then placed on the target shardings. Only a step whose every rank is present on
  this machine's view of `checkpoint.local_dir` can be read this way.

The newest step of either tier is chosen unless a step is asked for. `field="ema"` reads the
EMA of the parameters instead (a run with train.ema_decay: the `ema` subtree of the persistent
`train_state` item, the `ema/...` pieces of the local tier), shaped like the parameters.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np

from spmd.checkpoint.files import ChecksumError, crc32, hex32, read_json
from spmd.checkpoint.interface import CheckpointError
from spmd.checkpoint.layout import leaf_paths
from spmd.checkpoint.listing import scan_local, scan_persistent
from spmd.checkpoint.local import DATA, INDEX, MARKER, rank_name
from spmd.checkpoint.persistent import read_manifest, restore_args, verify_files
from spmd.checkpoint.state_items import LEGACY_ITEM, PARAMS, TRAIN_STATE

log = logging.getLogger("spmd.checkpoint")


@dataclass(frozen=True)
class ParamsCheckpoint:
    """One committed step whose parameters can be read: its tier and its directory."""

    step: int
    tier: str       # "persistent" | "local"
    path: Path      # the step's directory in its tier

    def describe(self) -> str:
        return f"step {self.step} from the {self.tier} tier ({self.path})"


def find_checkpoints(persistent_dir: Path | None, local_dir: Path | None
                     ) -> list[ParamsCheckpoint]:
    """Committed steps of both tiers, oldest first; at equal steps persistent comes last."""
    found = []
    if local_dir is not None:
        found += [ParamsCheckpoint(s.step, "local", Path(local_dir) / str(s.step))
                  for s in scan_local(Path(local_dir)) if s.committed]
    if persistent_dir is not None:
        found += [ParamsCheckpoint(s.step, "persistent", Path(persistent_dir) / str(s.step))
                  for s in scan_persistent(Path(persistent_dir)) if s.state == "committed"]
    return sorted(found, key=lambda c: (c.step, c.tier == "persistent"))


def choose_checkpoint(found: list[ParamsCheckpoint], step: int | None,
                      where: str) -> ParamsCheckpoint:
    """The newest checkpoint (or `step`'s); an error naming `where` and what exists."""
    if not found:
        raise CheckpointError(f"{where}: no committed checkpoint to load (a run saves its last "
                              f"step to the persistent tier unless checkpoint.final is false; "
                              f"`spmd ckpt ls` lists what is there)")
    if step is None:
        return found[-1]
    at = [c for c in found if c.step == step]
    if not at:
        steps = sorted({c.step for c in found})
        raise CheckpointError(f"{where}: no committed checkpoint of step {step}; committed "
                              f"steps: {steps}")
    return at[-1]


def read_params(ckpt: ParamsCheckpoint, target: Any, *, verify: bool = True,
                field: str = "params") -> Any:
    """The parameters of `ckpt` as jax.Arrays on `target`'s shapes, dtypes and shardings.

    `target`: the parameters' pure dict of jax.ShapeDtypeStructs carrying shardings.
    `verify`: check the files read against the step's checksums first. `field`: "params",
    or "ema" for the EMA of the parameters (a CheckpointError if the step holds none).
    """
    if field not in ("params", "ema"):
        raise ValueError(f"field must be 'params' or 'ema', not {field!r}")
    if ckpt.tier == "persistent":
        return _read_persistent(ckpt, target, verify, field)
    return _read_local(ckpt, target, field)


def _no_ema(ckpt: ParamsCheckpoint) -> CheckpointError:
    return CheckpointError(f"{ckpt.describe()} holds no EMA of the parameters (the run did not "
                           f"set train.ema_decay); load its parameters (ema=False)")


# ---------------------------------------------------------------- persistent tier


def _read_persistent(ckpt: ParamsCheckpoint, target: Any, verify: bool,
                     field: str = "params") -> Any:
    import orbax.checkpoint as ocp

    step_dir = ckpt.path
    legacy = not (step_dir / PARAMS).is_dir() and (step_dir / LEGACY_ITEM).is_dir()
    item = LEGACY_ITEM if legacy else (PARAMS if field == "params" else TRAIN_STATE)
    if verify:
        _verify_item(step_dir, item)
    subtree = legacy or field != "params"
    try:
        with ocp.PyTreeCheckpointer() as checkpointer:
            if subtree:  # the whole state (or the rest of it) in one item: read one subtree
                if field == "ema" and "ema" not in _top_keys(checkpointer, step_dir / item):
                    raise _no_ema(ckpt)
                args = restore_args({field: target})
                restored = checkpointer.restore(step_dir / item, args=ocp.args.PyTreeRestore(
                    item=args.item, restore_args=args.restore_args, partial_restore=True))
                return restored[field]
            return checkpointer.restore(step_dir / item, args=restore_args(target))
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"reading the parameters of {ckpt.describe()} failed (was it "
                              f"saved by another model or model config?): "
                              f"{type(e).__name__}: {str(e)[:1500]}") from e


def _top_keys(checkpointer: Any, item_dir: Path) -> set[str]:
    """Top-level keys of an Orbax pytree item (empty if its metadata cannot be read)."""
    try:
        meta = checkpointer.metadata(item_dir)
    except Exception:
        return set()
    tree = getattr(meta, "item_metadata", None)
    tree = meta if tree is None else tree
    tree = getattr(tree, "tree", tree)
    return set(tree) if isinstance(tree, Mapping) else set()


def _verify_item(step_dir: Path, item: str) -> None:
    """The manifest check of one item's files (the tier's own `verify_files`, one process)."""
    manifest = read_manifest(step_dir)
    if manifest is None:
        raise CheckpointError(f"{step_dir}: its manifest is missing or unreadable")
    files = {rel: want for rel, want in manifest["files"].items() if rel.startswith(f"{item}/")}
    problems = verify_files(step_dir, {**manifest, "files": files}, rank=0, size=1)
    if problems:
        raise CheckpointError("; ".join(problems))


# ---------------------------------------------------------------- local tier


def _rank_copies(step_dir: Path) -> dict[int, tuple[Path, Path, str]]:
    """rank -> (index, data, index crc) of a committed copy of its pieces (own first)."""
    copies: dict[int, tuple[Path, Path, str]] = {}
    partner_copies: dict[int, tuple[Path, Path, str]] = {}
    for d in sorted(step_dir.glob("rank*")):
        if not d.is_dir() or not (d / MARKER).is_file():
            continue
        marker = read_json(d / MARKER)
        files = marker.get("files", {})
        rank = int(marker["rank"])
        if INDEX in files:
            copies[rank] = (d / INDEX, d / DATA, files[INDEX])
        for q in marker.get("partners", []):
            base = f"partner-{rank_name(q)}"
            if f"{base}.json" in files:
                partner_copies.setdefault(q, (d / f"{base}.json", d / f"{base}.bin",
                                              files[f"{base}.json"]))
    return {**partner_copies, **copies}


def _read_local(ckpt: ParamsCheckpoint, target: Any, field: str = "params") -> Any:
    wanted = dict(zip((f"{field}/{p}" for p in leaf_paths(target)), jax.tree.leaves(target)))
    arrays = {path: np.empty(x.shape, np.dtype(x.dtype))
              for path, x in wanted.items()}
    filled = {path: 0 for path in wanted}
    copies = _rank_copies(ckpt.path)
    try:
        for index_path, data_path, index_crc in copies.values():
            index = read_json(index_path, index_crc)
            with open(data_path, "rb") as f:
                for piece in index["pieces"]:
                    path = piece["path"]
                    if path not in arrays:
                        continue
                    _place(f, data_path, piece, arrays[path])
                    filled[path] += int(piece["nbytes"])
    except (OSError, ChecksumError) as e:
        raise CheckpointError(f"reading the parameters of {ckpt.describe()} failed: {e}") from e
    short = [p for p, n in filled.items() if n < arrays[p].nbytes]
    if field == "ema" and short and all(n == 0 for n in filled.values()):
        raise _no_ema(ckpt)
    if short:
        raise CheckpointError(
            f"{ckpt.describe()}: parameters {short[:5]} are missing from the rank copies found "
            f"({sorted(copies)}); was it saved by another model config?")
    shardings = [x.sharding for x in wanted.values()]
    placed = [jax.make_array_from_callback(a.shape, s, lambda idx, a=a: a[idx])
              for a, s in zip(arrays.values(), shardings)]
    return jax.tree.unflatten(jax.tree.structure(target), placed)


def _place(f: Any, data_path: Path, piece: Mapping[str, Any], out: np.ndarray) -> None:
    """Read one piece from an open blob, check its crc32, copy it into `out` at its index."""
    f.seek(piece["offset"])
    raw = f.read(piece["nbytes"])
    if len(raw) != piece["nbytes"]:
        raise ChecksumError(data_path, f"ended inside piece {piece['path']}")
    got = hex32(crc32(raw))
    if got != piece["crc32"]:
        raise ChecksumError(data_path, f"piece {piece['path']} at offset {piece['offset']} "
                                       f"has crc32 {got}, the index says {piece['crc32']}")
    key = [tuple(k) for k in piece["index"]]
    shape = tuple(b - a for a, b in key)
    if np.dtype(out.dtype).name != piece["dtype"]:
        raise ChecksumError(data_path, f"piece {piece['path']} is {piece['dtype']}, the model "
                                       f"expects {out.dtype}")
    out[tuple(slice(a, b) for a, b in key)] = np.frombuffer(raw, out.dtype).reshape(shape)
