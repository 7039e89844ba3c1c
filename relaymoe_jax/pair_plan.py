"""Per-device token–expert pair plan, shared by every sharded dispatcher.

No communication. The T·K pairs of this device are sorted by expert id once; only int32 indices are sorted, never
a [T·K, D] activation copy. The pairs of the L experts of one partition then form one contiguous range.

An expert id outside [0, E) (which reaches here only where `moe_ffn` cannot check values: traced under `jit`)
sorts as the sentinel E: after every partition's range and counted for no expert, so no hop, chunk or all-to-all
slot ever reads it. Such a pair contributes nothing to the output and gets a zero router-weight gradient, as in
the dense oracle, whose one-hot of an out-of-range id is all zeros. Shape letters: see relaymoe_jax.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp


class PairPlan(NamedTuple):
  """Expert-sorted pairs of one device.

  Attributes:
    order_P: int32, flat pair index t·K + k of each sorted position (P = T·K).
    counts_E: int32, number of pairs per expert.
  """

  order_P: jax.Array
  counts_E: jax.Array

  def tokens(self, top_k):
    """int32 token index of each sorted pair."""
    return self.order_P // top_k



class PairRange(NamedTuple):
  """A contiguous range of expert-sorted pairs and its per-expert group sizes."""

  start: jax.Array
  count: jax.Array
  sizes_L: jax.Array


def partition_range(counts_E, p, experts_per_partition):
  """The sorted range holding the pairs of partition p (experts p·L … p·L + L − 1)."""
  num_l = experts_per_partition
  sizes_L = jax.lax.dynamic_slice_in_dim(counts_E, p * num_l, num_l)
  start = jnp.sum(jnp.where(jnp.arange(counts_E.shape[0]) < p * num_l, counts_E, 0))
  return PairRange(start=start, count=jnp.sum(sizes_L), sizes_L=sizes_L)


def make_pair_plan(idx_TK, num_experts):
  """Sorts this device's pairs by expert (stable, so token order is kept within an expert); out-of-range ids sort
  last and are counted nowhere."""
  expert_P = idx_TK.reshape(-1).astype(jnp.int32)
  # Left as they were, a negative id would sort first yet be counted for expert E + id (`.at` wraps it), shifting
  # every partition's range by a pair and mixing other tokens' pairs into the wrong experts.
  expert_P = jnp.where((expert_P >= 0) & (expert_P < num_experts), expert_P, num_experts)
  order_P = jnp.argsort(expert_P, stable=True).astype(jnp.int32)
  counts_E = jnp.zeros((num_experts,), jnp.int32).at[expert_P].add(1, mode="drop")
  return PairPlan(order_P=order_P, counts_E=counts_E)


def sorted_pair_weights(plan, w_TK):
  """Router weight of each sorted pair: a [T·K] gather, not an activation copy."""
  return w_TK.reshape(-1)[plan.order_P]


def unsort_pair_values(plan, v_P, shape_TK):
  """Inverse of `sorted_pair_weights`: puts per-pair values back in [T, K] order."""
  return jnp.zeros(v_P.shape, v_P.dtype).at[plan.order_P].set(v_P).reshape(shape_TK)


def chunk_group_sizes(sizes_L, offset, rows):
  """Group sizes of rows [offset, offset + rows) of a range whose groups have sizes_L.

  Rows past the range's end belong to no group, so the sizes sum to the chunk's valid row count.
  """
  ends_L = jnp.cumsum(sizes_L)
  begins_L = ends_L - sizes_L
  lo_L = jnp.maximum(begins_L, offset)
  hi_L = jnp.minimum(ends_L, offset + rows)
  return jnp.maximum(hi_L - lo_L, 0).astype(jnp.int32)
