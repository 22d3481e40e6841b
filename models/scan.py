"""Layer stacks: identical blocks stored with a leading `layers` axis and run with a scan.

Invariants:
- `stack_layers(blocks)` keeps every value of the unrolled blocks (block i's parameters are
  slice i of the stacked ones), so a scanned and an unrolled model built from the same
  `Rngs` start from identical parameters and compute the same function.
- Every stacked parameter's logical axes gain a leading `layers` (a name with a rule in
  every preset: replicated today), so `spmd shardings` and checkpoints see one array per
  parameter kind, shaped (num_layers, ...).
- `remat` names a policy in `REMAT_POLICIES`; the same policy wraps one block in both the
  scanned and the unrolled path, so their losses and gradients agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

from spmd.models.attention import ATTENTION_OUT
from spmd.sharding import LOGICAL_AXES_KEY
from spmd.sharding.pipeline import active_pipeline, run_pipeline

LAYERS = "layers"
Remat = Literal["none", "full", "dots", "dots_with_batch", "save_attention"]

_policies = jax.checkpoint_policies
# None: no jax.checkpoint at all. Otherwise the policy says what the backward may keep.
REMAT_POLICIES: dict[str, object] = {
    "none": None,
    "full": _policies.nothing_saveable,                     # keep only the block's input
    "dots": _policies.dots_with_no_batch_dims_saveable,     # keep weight matmuls' outputs
    "dots_with_batch": _policies.dots_saveable,             # ... and attention's batched dots
    "save_attention": _policies.save_only_these_names(ATTENTION_OUT),  # attention output only
}


def stack_layers(blocks: Sequence[nnx.Module]) -> nnx.Module:
    """One module of the blocks' structure whose parameters are stacked along `layers`."""
    graphdef, _ = nnx.split(blocks[0])
    flats = [list(nnx.to_flat_state(nnx.split(b)[1])) for b in blocks]
    stacked = []
    for i, (path, variable) in enumerate(flats[0]):
        value = jnp.stack([flat[i][1].get_value() for flat in flats])
        metadata = {}
        axes = variable.get_metadata().get(LOGICAL_AXES_KEY)
        if axes is not None:
            metadata[LOGICAL_AXES_KEY] = (LAYERS, *axes)
        stacked.append((path, variable.replace(value, **metadata)))
    return nnx.merge(graphdef, nnx.from_flat_state(stacked))


def layer_of(stacked: nnx.Module, index: int) -> nnx.Module:
    """Block `index` of a stacked module, as an ordinary (unstacked) block."""
    graphdef, state = nnx.split(stacked)
    return nnx.merge(graphdef, jax.tree.map(lambda v: v[index], state))


def _block_fn(graphdef: nnx.GraphDef, remat: str, prevent_cse: bool):
    def apply(state, x):
        return nnx.merge(graphdef, state)(x)

    if remat not in REMAT_POLICIES:
        raise ValueError(f"unknown remat policy '{remat}'; choose one of "
                         f"{', '.join(REMAT_POLICIES)}")
    if remat == "none":
        return apply
    # prevent_cse=False is safe (and faster) inside scan; the unrolled path wants True.
    return jax.checkpoint(apply, policy=REMAT_POLICIES[remat], prevent_cse=prevent_cse)


def run_stacked(stacked: nnx.Module, x: jax.Array, remat: str = "none") -> jax.Array:
    """x -> block_{L-1}(... block_0(x)) with one `jax.lax.scan` over the `layers` axis.

    When the bound rules shard `layers` over pipeline stages (spmd.sharding.pipeline),
    the same blocks run as a pipeline of microbatches instead.
    """
    graphdef, state = nnx.split(stacked)
    block = _block_fn(graphdef, remat, prevent_cse=False)
    stages = active_pipeline()
    if stages is not None:
        return run_pipeline(block, state, x, stages)

    def body(carry, layer_state):
        return block(layer_state, carry), None

    x, _ = jax.lax.scan(body, x, state)
    return x


def run_unrolled(blocks: Sequence[nnx.Module], x: jax.Array, remat: str = "none") -> jax.Array:
    """The same computation as `run_stacked`, one traced copy per block (for debugging)."""
    for block in blocks:
        graphdef, state = nnx.split(block)
        x = _block_fn(graphdef, remat, prevent_cse=True)(state, x)
    return x
