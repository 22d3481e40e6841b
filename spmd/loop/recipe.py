"""Changing the recipe between jobs of one run: what changed, and what is restored.

The run directory's config.yaml is the previous job's config (rank 0 rewrites it once the new
config builds); every rank reads it first (`previous_recipe`). On restore (`restore_state`):

- The same `optimizer.name`: the whole train state is restored, parameters and optimizer
  state alike, whatever else changed; a changed learning rate, schedule or `train.steps`
  (the schedule's horizon) is logged, key by key, with a `recipe_changed` event, and takes
  effect from the restored step on (the schedule is a function of the step).
- Another `optimizer.name`, with `checkpoint.params_only: true`: the parameters alone are
  restored (and the EMA starts from them); the optimizer state is the new optimizer's fresh
  one, and training goes on from the checkpoint's step (its data position, its schedule
  value, the step numbers of metrics.jsonl and of the checkpoints). Later jobs find the new
  optimizer in config.yaml and restore everything again. A full restore that fails while
  `params_only` is on (a job that switched optimizers and ended before its first save) also
  falls back to the parameters.
- Another `optimizer.name` without it: a one-line error naming both names.

The data order (`data.shuffle_block`, `data.shuffle_mix`) is the run's own: a key the
job's config leaves unset takes the previous job's value (`keep_data_order`), whatever this
version's default is, so the job reads the batches the previous job would have read; a
config.yaml written before `data.shuffle_mix` existed read blocks one at a time and, with
`shuffle_block` unset, shuffled in full. A job that sets them to another order trains on
with it, with a warning.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import yaml

from spmd.checkpoint import Checkpointer, CheckpointError, Restored
from spmd.config.schema import Config, migrate_deprecated
from spmd.data.order import FULL_SHUFFLE
from spmd.engine.engine_config import EngineSections
from spmd.engine.nonfinite import (
    form_of,
    nonfinite_switched,
    record_form,
    restore_any_form,
    saved_form,
)
from spmd.engine.runtime import Runtime
from spmd.engine.state import ADDED_FIELDS, TrainState, fill_ema, train_rng
from spmd.errors import ConfigError
from spmd.optim import OptimizerConfig, ScheduleConfig

log = logging.getLogger("spmd.loop.trainer")

CONFIG_FILE = "config.yaml"


@dataclasses.dataclass(frozen=True)
class Recipe:
    """The parts of a config that shape the updates, flattened: `optimizer.lr` -> 3e-3."""

    values: dict[str, Any]

    @property
    def optimizer_name(self) -> str:
        return str(self.values.get("optimizer.name", "adamw"))

    @classmethod
    def of(cls, cfg: EngineSections | Config) -> Recipe:
        return cls(_recipe_values(cfg.optimizer.model_dump(mode="json"),
                                  cfg.schedule.model_dump(mode="json"), cfg.train.steps))

    def changes(self, new: Recipe) -> list[tuple[str, Any, Any]]:
        """(key, previous value, this job's value) for every key that differs."""
        keys = sorted(set(self.values) | set(new.values))
        return [(k, self.values.get(k), new.values.get(k)) for k in keys
                if self.values.get(k) != new.values.get(k)]


def _recipe_values(optimizer: dict, schedule: dict, steps: Any) -> dict[str, Any]:
    out = {f"optimizer.{k}": v for k, v in optimizer.items() if v is not None and v != {}}
    out.update({f"schedule.{k}": v for k, v in schedule.items() if v is not None and v != []})
    out["train.steps"] = steps
    return out


def _previous_config(run_dir: Path) -> dict | None:
    """The run directory's config.yaml (the previous job's) as a dict, None if there is none
    or it does not read (old keys are read as their new ones, silently)."""
    path = Path(run_dir) / CONFIG_FILE
    try:
        raw = migrate_deprecated(yaml.safe_load(path.read_text()), warn=False)
    except (OSError, yaml.YAMLError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None


def previous_recipe(run_dir: Path) -> Recipe | None:
    """The recipe of the run directory's config.yaml (the previous job's), None if there is
    none or it does not read."""
    raw = _previous_config(run_dir)
    if raw is None:
        return None
    sections = []
    for key, cls in (("optimizer", OptimizerConfig), ("schedule", ScheduleConfig)):
        section = raw.get(key) or {}
        try:
            sections.append(cls.model_validate(section).model_dump(mode="json"))
        except Exception:   # a key this version does not know: compare what is there
            sections.append({**cls().model_dump(mode="json"),
                             **(section if isinstance(section, dict) else {})})
    train = raw.get("train") if isinstance(raw.get("train"), dict) else {}
    return Recipe(_recipe_values(sections[0], sections[1], train.get("steps")))


def _order(block: Any, mix: Any) -> tuple[Any, ...]:
    """A data order setting, compared by what it reads: every spelling of a full shuffle is
    one order, whatever the mix."""
    return ("full",) if block in FULL_SHUFFLE else (block, mix)


def keep_data_order(cfg: Config, run_dir: Path) -> tuple[Config, tuple[int, str] | None]:
    """`cfg` with the data order of the run's previous job for each order key `cfg` leaves
    unset, and a (logging level, line) when the order is kept or changed (None: the same
    order, or no previous job). Every rank reads the same config.yaml, so every rank
    agrees."""
    raw = _previous_config(run_dir)
    data = raw.get("data") if raw is not None else None
    if not isinstance(data, dict):
        return cfg, None
    block = data.get("shuffle_block")
    mix = data.get("shuffle_mix", 1)      # before data.shuffle_mix: one block at a time
    given = cfg.data.model_fields_set
    wanted = {"shuffle_block": cfg.data.shuffle_block if "shuffle_block" in given else block,
              "shuffle_mix": cfg.data.shuffle_mix if "shuffle_mix" in given else mix}
    where = f"{Path(run_dir) / CONFIG_FILE}"
    previous = f"data.shuffle_block={_show(block)}, data.shuffle_mix={mix}"
    if _order(block, mix) != _order(*wanted.values()):
        return cfg, (logging.WARNING,
                     f"data order changed: the previous job read {previous} ({where}), "
                     f"this job data.shuffle_block={_show(cfg.data.shuffle_block)}, "
                     f"data.shuffle_mix={cfg.data.shuffle_mix}: steps from the restored one "
                     f"on read other batches than the previous job would have")
    if _order(cfg.data.shuffle_block, cfg.data.shuffle_mix) == _order(*wanted.values()):
        return cfg, None
    try:
        kept = cfg.data.model_validate({**cfg.data.model_dump(by_alias=True), **wanted})
    except Exception:   # noqa: BLE001 - a value this version cannot read: the default
        return cfg, (logging.WARNING,
                     f"the previous job's data order ({previous}, {where}) does not read "
                     f"in this version; this job reads the default order, other batches")
    return cfg.model_copy(update={"data": kept}), (
        logging.INFO, f"data order: the run's own ({previous}, from {where}); set "
                      f"data.shuffle_block and data.shuffle_mix to change it")


def restore_state(rt: Runtime, checkpointer: Checkpointer, previous: Recipe | None,
                  run_dir: Path, events: Any, params_only: bool = False) -> Restored | None:
    """Collective: the restored state as this config's recipe allows (module docstring), or
    None (nothing to restore: initialize). `params_only`: `checkpoint.params_only`. Rank 0
    then records the train.nonfinite form of the steps this job saves (spmd.engine.nonfinite).
    """
    restored = _restore_state(rt, checkpointer, previous, run_dir, events, params_only)
    if jax.process_index() == 0:
        record_form(run_dir, restored.step if restored is not None else 0,
                    rt.sections.train.nonfinite)
    return restored


def _restore_state(rt: Runtime, checkpointer: Checkpointer, previous: Recipe | None,
                   run_dir: Path, events: Any, params_only: bool) -> Restored | None:
    cfg, is_main = rt.sections, jax.process_index() == 0
    current = Recipe.of(cfg)
    old_name, new_name = (previous.optimizer_name if previous else None), cfg.optimizer.name
    if old_name is not None and old_name != new_name:
        newest = checkpointer.newest_step()
        if newest is None:
            return None
        if not params_only:
            raise ConfigError(
                f"{run_dir} holds checkpoints (newest: step {newest}) of optimizer.name="
                f"{old_name} (its {CONFIG_FILE}), this config has optimizer.name={new_name}: "
                f"set checkpoint.params_only=true to restore the parameters alone with a "
                f"fresh {new_name} state, or train in another run.dir")
        return _params_only(rt, checkpointer, f"optimizer.name {old_name} -> {new_name}")
    # the newest step's train.nonfinite form, as recorded; else the previous job's mode
    saved = ((_previous_config(run_dir) or {}).get("train") or {}).get("nonfinite", "stop")
    saved = saved_form(run_dir, checkpointer.newest_step()) or (saved if previous else None)
    abstract = rt.state.abstract
    try:   # an older step (a fallback) may be in the other form: restore_any_form
        restored, target = restore_any_form(
            lambda t: checkpointer.restore(t, optional=ADDED_FIELDS,
                                           **({} if t is abstract else {"saves": abstract})),
            abstract, saved, (CheckpointError,))
        if restored is not None and target is not abstract:
            restored = dataclasses.replace(restored,
                                           state=nonfinite_switched(restored.state, abstract))
            if is_main:
                log.info("train.nonfinite %s -> %s: the optimizer state of step %d is "
                         "restored into this job's form", form_of(target),
                         cfg.train.nonfinite, restored.step)
    except CheckpointError as e:
        if not params_only:
            raise
        if is_main:
            log.warning("restoring the whole state failed (%s); checkpoint.params_only is on: "
                        "restoring the parameters alone", str(e).splitlines()[0][:300])
        return _params_only(rt, checkpointer, "the whole state did not restore")
    if restored is None and params_only and checkpointer.newest_step() is not None:
        return _params_only(rt, checkpointer, "no checkpoint of this state's layout")
    if restored is not None and previous is not None:
        changes = previous.changes(current)
        if changes and is_main:
            log.info("the recipe changed since the previous job (%s/%s): %s; parameters and "
                     "optimizer state are restored as saved at step %d, the new values apply "
                     "from there on", run_dir, CONFIG_FILE,
                     ", ".join(f"{k} {_show(a)} -> {_show(b)}" for k, a, b in changes),
                     restored.step)
        if changes:
            events.emit("recipe_changed", step=restored.step,
                        changes={k: [a, b] for k, a, b in changes})
    return restored


def _show(value: Any) -> str:
    return "(unset)" if value is None else str(value)


def _params_only(rt: Runtime, checkpointer: Checkpointer, why: str) -> Restored | None:
    """The parameters of the newest checkpoint in a fresh train state at its step."""
    restored = checkpointer.restore_params(rt.state.abstract.params)
    if restored is None:
        return None
    shardings = rt.state.shardings
    params = restored.state
    state = rt.state.abstract.replace(
        step=jax.device_put(jnp.asarray(restored.step, jnp.int32), shardings.step),
        params=params,
        opt_state=jax.jit(rt.tx.init, out_shardings=shardings.opt_state)(params),
        rng=jax.device_put(train_rng(rt.sections.train.seed), shardings.rng),
        ema=None)
    if shardings.ema is not None:
        state = fill_ema(state, shardings)
    if jax.process_index() == 0:
        log.warning("checkpoint.params_only (%s): restored the parameters of step %d alone; "
                    "the %s optimizer state starts fresh, training goes on from step %d",
                    why, restored.step, rt.sections.optimizer.name, restored.step)
    return dataclasses.replace(restored, state=state)


def fill_missing(rt: Runtime, restored: Restored) -> TrainState:
    """The restored state, with fields a checkpoint written before they existed lacks (the
    RNG key: `ADDED_FIELDS`) filled from the config, as a fresh run would have them; an EMA
    the checkpoint lacks (saved before train.ema_decay was set) starts from its params."""
    state = restored.state
    if "rng" in restored.missing:
        seed = rt.sections.train.seed
        state = state.replace(rng=jax.device_put(train_rng(seed), rt.state.shardings.rng))
        if jax.process_index() == 0:
            log.info("the checkpoint of step %d holds no RNG key (written before the train "
                     "state had one): set from train.seed=%d", restored.step, seed)
    if "ema" in restored.missing and rt.state.shardings.ema is not None:
        state = fill_ema(state, rt.state.shardings)
        if jax.process_index() == 0:
            log.info("the checkpoint of step %d holds no EMA of the parameters (saved without "
                     "train.ema_decay): the EMA starts from its parameters", restored.step)
    return state
