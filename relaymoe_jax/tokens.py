"""Token shapes around the MoE block: [..., D] folded into [T, D] and back, T padded to the token shards, and the
guard that turns `jax.vmap` over the block into an error naming the way out.

No communication of its own beyond the reshards an Explicit mesh needs for a reshape. Padding rows route to the
expert id E, which no dispatcher counts: they meet no expert in any hop, chunk or all-to-all slot, cost nothing
in the ring, and get zero output and zero gradients (see `pair_plan`). Shape letters: see relaymoe_jax.
"""

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap
from jax.sharding import NamedSharding, PartitionSpec as P

from relaymoe_jax.errors import UserError

VMAP_MESSAGE = (
    "the MoE block cannot run under jax.vmap: its grouped matmul (lax.ragged_dot) batches over no dimension but "
    "its first, and the rings place tokens on the mesh themselves. Call it without vmap on the whole batch instead: "
    "moe_ffn, route and the rm.linen.MoE / rm.nnx.MoE layers take x [..., D] and fold every leading dim into "
    "tokens (x_BSD works as it is; for vmap over examples, move the vmapped axis into x's leading dims).")

VMAP_OVER_WEIGHTS_MESSAGE = (
    "the MoE block cannot run under jax.vmap over its expert weights (an ensemble of blocks): its grouped matmul "
    "(lax.ragged_dot) batches over no dimension but its first, and the rings place experts on the mesh themselves. "
    "Call it once per member (a Python loop or lax.map over the stacked weights), or fold the members into one "
    "block with E·members experts and route each member's tokens to its own.")


def _leading_spec(layout, a):
  """The sharding of a's first dim alone, on an Explicit mesh: a reshape merging the leading dims keeps it."""
  spec = tuple(jax.typeof(a).sharding.spec) or (None,)
  return NamedSharding(layout.mesh, P(spec[0]))


def fold(layout, a):
  """a [..., X] as [prod(...), X]."""
  if a.ndim == 2:
    return a
  if layout.explicit:
    a = jax.sharding.reshard(a, _leading_spec(layout, a))
  return a.reshape(-1, a.shape[-1])


def unfold(layout, y_TD, like):
  """y_TD back to `like`'s leading dims, sharded on the first of them as `like` is (Explicit meshes)."""
  if like.ndim == 2:
    return y_TD
  if layout.explicit:
    y_TD = jax.sharding.reshard(y_TD, _leading_spec(layout, like))
  return y_TD.reshape(*like.shape[:-1], y_TD.shape[-1])


def pad_rows(a, rows, value):
  """a with `rows` rows of `value` appended (nothing when rows is 0)."""
  if not rows:
    return a
  return jnp.concatenate([a, jnp.full((rows, *a.shape[1:]), value, a.dtype)])


def padding_for(layout, tokens):
  """Rows that bring `tokens` to a multiple of the token shards."""
  return -tokens % layout.token_shards


@custom_vmap
def _refuse_vmap(arrays):
  return arrays


@_refuse_vmap.def_vmap
def _refuse_vmap_rule(axis_size, in_batched, arrays):
  x_batched, *_, experts_batched = in_batched[0]  # (x_TD, w_TK, w_gate_EDF, w_up_EDF, w_down_EFD)
  raise UserError(VMAP_MESSAGE if x_batched or not experts_batched else VMAP_OVER_WEIGHTS_MESSAGE)


@jax.custom_vjp
def refuse_vmap(arrays):
  """Identity on a tuple of float arrays; under `jax.vmap` it raises ValueError(VMAP_MESSAGE) at trace time.

  A custom_vjp around the custom_vmap because custom_vmap alone cannot be linearized: `grad` then runs only the
  forward rule, which is the identity."""
  return _refuse_vmap(arrays)


def _refuse_vmap_fwd(arrays):
  return _refuse_vmap(arrays), None


def _refuse_vmap_bwd(_, ct):
  return (ct,)


refuse_vmap.defvjp(_refuse_vmap_fwd, _refuse_vmap_bwd)
