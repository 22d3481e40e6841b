"""The `optimizer:` section and the optax transformation it names.

`name` is one of `OPTIMIZERS` (optax's implementations; `muon` is `optax.contrib.muon`) or
`module:function`, any function returning an `optax.GradientTransformation` (it is called
with `learning_rate=<the schedule>` and the keyword arguments of `optimizer.kwargs`). Each
built-in optimizer takes the parameters listed in `PARAMETERS` (unset: optax's default);
one set for another optimizer is an error naming the valid ones.

Weight decay (`weight_decay`, 0: none) is decoupled (multiplied by the learning rate and
added to the update, as AdamW) for adamw, lion, adafactor and muon, and added to the
gradient (L2, as torch.optim.SGD/Adam) for sgd, adam and a `module:function` optimizer. It
applies to the parameters the mask selects (`decays`): by default every parameter except

- those with at most one dimension besides a stacked-layers axis (logical axis `layers`):
  biases and norm scales;
- embedding tables: parameters whose first logical axis (after `layers`) is `vocab` (token
  embeddings, `(vocab, embed)`) or `length` (learned positions, `(length, embed)`), and
  parameters whose own name (the path's last part) is `embed`, `embedding`, `embeddings` or
  ends in `_embed`, `_embedding`, `_embeddings` (e.g. `pos_embed`).

`no_decay` replaces these rules with a list of entries, each a glob over the parameter's
path (`blocks/*/attn/*`, `*/bias`; fnmatch, `*` crosses `/`), `axis:NAME` (a parameter with
logical axis NAME), or `default` (the default rules above). `spmd optimizer CONFIG` lists
which parameters decay.
"""

from __future__ import annotations

import fnmatch
import importlib
import re
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

if TYPE_CHECKING:   # the config schema imports this module: optax and jax load when used
    import optax

OPTIMIZERS = ("adamw", "adam", "sgd", "lion", "adafactor", "muon")

# The section's parameters each built-in optimizer takes (names as optax's arguments).
PARAMETERS: dict[str, tuple[str, ...]] = {
    "adamw": ("b1", "b2", "eps", "eps_root", "nesterov", "mu_dtype"),
    "adam": ("b1", "b2", "eps", "eps_root", "nesterov", "mu_dtype"),
    "sgd": ("momentum", "nesterov"),
    "lion": ("b1", "b2", "mu_dtype"),
    "adafactor": ("decay_rate", "decay_offset", "min_dim_size_to_factor",
                  "multiply_by_parameter_scale", "clipping_threshold", "momentum", "eps",
                  "factored"),
    "muon": ("beta", "ns_steps", "eps", "nesterov", "mu_dtype", "adam_b1", "adam_b2"),
}
ALL_PARAMETERS = tuple(sorted({p for ps in PARAMETERS.values() for p in ps}))
# How weight decay is passed to each optimizer: (keyword of the rate, keyword of the mask);
# None: added to the gradient before the optimizer (optax.add_decayed_weights).
_DECAY_ARGS: dict[str, tuple[str, str] | None] = {
    "adamw": ("weight_decay", "mask"), "lion": ("weight_decay", "mask"),
    "adafactor": ("weight_decay_rate", "weight_decay_mask"),
    "muon": ("weight_decay", "weight_decay_mask"), "adam": None, "sgd": None,
}
_FUNCTION = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
_EMBEDDING_NAME = re.compile(r"^(?:.*_)?(?:embed|embedding|embeddings)$")


def _takes(parameter: str) -> str:
    """A per-optimizer parameter's description: which optimizers take it."""
    names = ", ".join(n for n, ps in PARAMETERS.items() if parameter in ps)
    return f"Passed to optax as `{parameter}` by {names}; null: optax's default."


class OptimizerConfig(BaseModel):
    """optimizer: the update rule, its peak learning rate, weight decay and clipping."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(
        "adamw", description="The update rule: adamw, adam, sgd, lion, adafactor, muon "
        "(optax's; muon is optax.contrib.muon), or `module:function` returning an "
        "optax.GradientTransformation (called with learning_rate= the schedule and "
        "optimizer.kwargs). A task's own optimizer(schedule), when it returns one, wins.")
    lr: float = Field(
        1e-3, gt=0, description="The peak learning rate (the schedule: section gives its shape).")
    weight_decay: float = Field(
        0.0, ge=0, description="Weight decay: decoupled for adamw, lion, adafactor, muon; added "
        "to the gradient for sgd, adam. Applies where optimizer.no_decay does not exempt.")
    no_decay: list[str] | None = Field(
        None, description="The parameters weight decay skips. null: the default exemptions "
        "(biases and norm scales, embeddings); else globs over parameter paths, `axis:NAME` "
        "(a logical axis) or `default` (the default exemptions). `spmd optimizer CONFIG` "
        "lists the result.")
    grad_clip: float | None = Field(
        1.0, gt=0, description="Clip the gradients' global norm to this. null: no clipping.")
    b1: float | None = Field(None, description=_takes("b1"))
    b2: float | None = Field(None, description=_takes("b2"))
    eps: float | None = Field(None, description=_takes("eps"))
    eps_root: float | None = Field(None, description=_takes("eps_root"))
    nesterov: bool | None = Field(None, description=_takes("nesterov"))
    momentum: float | None = Field(None, description=_takes("momentum"))
    mu_dtype: str | None = Field(None, description=_takes("mu_dtype"))
    decay_rate: float | None = Field(None, description=_takes("decay_rate"))
    decay_offset: int | None = Field(None, description=_takes("decay_offset"))
    min_dim_size_to_factor: int | None = Field(None, description=_takes("min_dim_size_to_factor"))
    multiply_by_parameter_scale: bool | None = Field(
        None, description=_takes("multiply_by_parameter_scale"))
    clipping_threshold: float | None = Field(None, description=_takes("clipping_threshold"))
    factored: bool | None = Field(None, description=_takes("factored"))
    beta: float | None = Field(None, description=_takes("beta"))
    ns_steps: int | None = Field(None, description=_takes("ns_steps"))
    adam_b1: float | None = Field(None, description=_takes("adam_b1"))
    adam_b2: float | None = Field(None, description=_takes("adam_b2"))
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments of a `module:function` optimizer.")

    @model_validator(mode="after")
    def _known(self) -> OptimizerConfig:
        given = sorted(p for p in ALL_PARAMETERS if getattr(self, p) is not None)
        if self.name in PARAMETERS:
            valid = PARAMETERS[self.name]
            wrong = [p for p in given if p not in valid]
            if wrong:
                raise ValueError(
                    f"optimizer.{wrong[0]} is not a parameter of optimizer.name={self.name} "
                    f"(its parameters: {', '.join(valid)}; and for every optimizer: lr, "
                    f"weight_decay, no_decay, grad_clip)")
            if self.kwargs:
                raise ValueError(f"optimizer.kwargs is for a module:function optimizer; "
                                 f"{self.name} takes {', '.join(valid)}")
        elif _FUNCTION.match(self.name):
            if given:
                raise ValueError(
                    f"optimizer.{given[0]} is a parameter of the built-in optimizers; a "
                    f"module:function optimizer ({self.name}) takes its arguments from "
                    f"optimizer.kwargs")
        else:
            raise ValueError(f"optimizer.name must be one of {', '.join(OPTIMIZERS)} or "
                             f"module:function (returning an optax.GradientTransformation); "
                             f"got {self.name!r}")
        return self

    def parameters(self) -> dict[str, Any]:
        """The optimizer-specific parameters that are set (passed on to optax)."""
        return {p: getattr(self, p) for p in ALL_PARAMETERS if getattr(self, p) is not None}


# ---------------------------------------------------------------- weight-decay mask


def path_of(key_path: Sequence[Any]) -> str:
    """A jax key path as `a/b/0/c` (the form of `spmd shardings`' paths)."""
    parts = []
    for k in key_path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def default_exempt(path: str, ndim: int, axes: Sequence[str | None] | None) -> bool:
    """Whether the default rules exempt a parameter from weight decay (module docstring)."""
    axes = tuple(axes) if axes is not None else ()
    own = [a for a in axes if a != "layers"] if axes else None
    dims = len(own) if own is not None and len(axes) == ndim else ndim
    if dims <= 1:
        return True
    if own and own[0] in ("vocab", "length"):
        return True
    return bool(_EMBEDDING_NAME.match(path.rsplit("/", 1)[-1]))


def decays(path: str, ndim: int, axes: Sequence[str | None] | None,
           no_decay: Sequence[str] | None) -> bool:
    """Whether weight decay applies to the parameter at `path` (`optimizer.no_decay`)."""
    if no_decay is None:
        return not default_exempt(path, ndim, axes)
    for entry in no_decay:
        if entry == "default":
            if default_exempt(path, ndim, axes):
                return False
        elif entry.startswith("axis:"):
            if axes and entry[5:] in axes:
                return False
        elif fnmatch.fnmatchcase(path, entry):
            return False
    return True


def decay_mask(no_decay: Sequence[str] | None,
               logical_axes: Mapping[str, Sequence[str | None]] | None = None
               ) -> Callable[[Any], Any]:
    """An optax `mask=` callable: the params tree -> True where weight decay applies.

    `logical_axes`: parameter path -> its logical axes (the model's sharding report)."""
    axes_of = dict(logical_axes or {})

    def mask(params: Any) -> Any:
        import jax

        return jax.tree_util.tree_map_with_path(
            lambda kp, x: decays(path_of(kp), len(getattr(x, "shape", ())),
                                 axes_of.get(path_of(kp)), no_decay), params)

    return mask


# ---------------------------------------------------------------- the transformation


def import_function(spec: str) -> Callable[..., Any]:
    """The function named `module:function` (optimizer.name)."""
    module_name, _, attr = spec.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"optimizer.name={spec}: cannot import it ({type(e).__name__}: "
                         f"{e})") from None
    if not callable(obj):
        raise ValueError(f"optimizer.name={spec} is not a function")
    return obj


def _builtin(name: str) -> Callable[..., optax.GradientTransformation]:
    import optax

    if name == "muon":
        from optax import contrib
        return contrib.muon
    return getattr(optax, name)


def build_optimizer(cfg: OptimizerConfig, schedule: optax.Schedule,
                    mask: Any = None) -> optax.GradientTransformation:
    """The update rule of `cfg` on `schedule`, with weight decay on `mask` (a tree or an
    optax mask callable; None: every parameter). No clipping (see `with_clipping`)."""
    import jax
    import optax

    if cfg.name not in PARAMETERS:
        fn = import_function(cfg.name)
        try:
            tx = fn(learning_rate=schedule, **cfg.kwargs)
        except TypeError as e:
            raise ValueError(f"optimizer.name={cfg.name}: calling it with learning_rate= and "
                             f"optimizer.kwargs {sorted(cfg.kwargs)} failed: {e}") from None
        if not isinstance(tx, optax.GradientTransformation):
            raise ValueError(f"optimizer.name={cfg.name} returned {type(tx).__name__}, not an "
                             f"optax.GradientTransformation")
        return _with_coupled_decay(tx, cfg.weight_decay, mask)
    kwargs = cfg.parameters()
    if "mu_dtype" in kwargs:
        kwargs["mu_dtype"] = jax.numpy.dtype(kwargs["mu_dtype"])
    decay = _DECAY_ARGS[cfg.name]
    if decay is not None and cfg.weight_decay:
        kwargs[decay[0]] = cfg.weight_decay
        kwargs[decay[1]] = mask
    elif decay is not None and cfg.name in ("adamw", "lion"):
        kwargs[decay[0]] = 0.0      # optax's own defaults are not 0
    tx = _builtin(cfg.name)(learning_rate=schedule, **kwargs)
    if decay is None:
        tx = _with_coupled_decay(tx, cfg.weight_decay, mask)
    return tx


def _with_coupled_decay(tx: optax.GradientTransformation, rate: float,
                        mask: Any) -> optax.GradientTransformation:
    import optax

    if not rate:
        return tx
    return optax.chain(optax.add_decayed_weights(rate, mask), tx)


def with_clipping(tx: optax.GradientTransformation,
                  grad_clip: float | None) -> optax.GradientTransformation:
    """`optax.chain` of clipping the gradients' global norm to `grad_clip` (None: none) and
    `tx` (the chain's state layout is that of every earlier spmd: checkpoints restore)."""
    import optax

    parts = [optax.clip_by_global_norm(grad_clip)] if grad_clip else []
    return optax.chain(*parts, tx)

