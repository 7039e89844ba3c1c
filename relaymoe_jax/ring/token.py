"""Token-routing ring (RelayMoE §3.2): token partitions circulate, expert weights stay.

Communication, over a ring of N devices along the expert axis (device r sends to r + 1):
  forward   `ring_relay` of each device's token partition (rows x_TD, pair plan: sorted token ids, router
            weights, per-expert counts): at hop h device r holds the partition of device (r − h) mod N and
            computes its pairs whose experts are local into a float32 [T, D] partial; the partition's output
            accumulator follows its tokens one hop behind and comes home after N hops. N − 1 token sends,
            N accumulator sends.
  backward  `ring_relay` again with the output gradient added to the travelling tokens; the relayed
            accumulators are dx (float32 [T, D]) and d(router weight) (float32 [T·K]); each hop recomputes its
            intermediates. Expert weight gradients accumulate where the experts live: no relay. They are then
            summed over the data-parallel token axes; under expert tensor parallelism outputs, dx and
            d(router weight) are summed over the tensor axis.
Shape letters: see relaymoe_jax.
"""

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from relaymoe_jax import gate_up
from relaymoe_jax.ring.hop import (TokenSide, backward_pairs, forward_pairs, token_side, with_token_positions,
                              zero_pair_grads)
from relaymoe_jax.layout import vary_like, varying_zeros
from relaymoe_jax.pair_plan import PairPlan, make_pair_plan, partition_range
from relaymoe_jax.ring.schedule import ring_relay
from relaymoe_jax.ring.vjp import backward_outputs, make_ring_spec, ring_vjp


class _Partition(NamedTuple):
  """What travels: one device's tokens and pair plan (and, in backward, its output gradient)."""

  tokens: TokenSide
  counts_E: jax.Array
  dy_TD: jax.Array | None = None


def _local_range(spec, counts_E):
  """Pairs of the visiting tokens whose experts live on this device."""
  r = jax.lax.axis_index(spec.layout.expert_axis)
  return partition_range(counts_E, r, spec.experts_per_device)


def _identity(x):
  return x


def _forward_device(x_TD, idx_TK, w_TK, w_gate_LDF, w_up_LDF, w_down_LFD, *, spec):
  layout = spec.layout
  plan = make_pair_plan(idx_TK, spec.num_experts)
  weights = (gate_up.input_weights(w_gate_LDF, w_up_LDF), w_down_LFD)

  def hop(state, _partition, visiting):
    zeros_TD = varying_zeros(x_TD.shape, jnp.float32, layout.compute_axes)
    tokens = with_token_positions(visiting.tokens, spec.chunk_rows, spec.top_k)  # not sent: found on arrival
    partial, _ = forward_pairs(tokens, _local_range(spec, visiting.counts_E), weights, zeros_TD,
                               static_chunks=spec.static_chunks, **spec.chunk_options)
    return state, partial

  own = _Partition(token_side(x_TD, plan, w_TK), plan.counts_E)
  _, acc_TD = ring_relay(hop, (), own, axis=layout.expert_axis, n=layout.ring_size, to_relay=_identity)
  return layout.sum_tensor_partials(acc_TD).astype(x_TD.dtype), plan.order_P, plan.counts_E


def _backward_device(x_TD, w_TK, w_gate_LDF, w_up_LDF, w_down_LFD, order_P, counts_E, dy_TD, *, spec):
  layout = spec.layout
  plan = PairPlan(order_P=order_P, counts_E=counts_E)
  weights = tuple(vary_like(w, layout.compute_axes) for w in (gate_up.input_weights(w_gate_LDF, w_up_LDF), w_down_LFD))

  def hop(dW, _partition, visiting):
    grads = zero_pair_grads(x_TD, order_P.shape[0], layout.compute_axes, spec.chunk_rows)
    tokens = with_token_positions(visiting.tokens, spec.chunk_rows, spec.top_k)
    grads, dW = backward_pairs(tokens, visiting.dy_TD, _local_range(spec, visiting.counts_E), weights,
                               grads, dW, vary_axes=layout.compute_axes, **spec.chunk_options)
    return dW, grads

  own = _Partition(token_side(x_TD, plan, w_TK), counts_E, dy_TD)
  dW0 = tuple(varying_zeros(w.shape, jnp.float32, layout.compute_axes) for w in weights)
  (dw_gate_up, dw_down), grads = ring_relay(hop, dW0, own, axis=layout.expert_axis, n=layout.ring_size,
                                            to_relay=_identity)
  return backward_outputs(spec, plan, grads, dw_gate_up, dw_down, x_TD, w_TK)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RingToken:
  """Token-routing ring dispatcher: preferable when expert weights are large next to a device's tokens.

  Attributes:
    chunk_rows, max_chunk_rows: chunk sizes of a hop, as for `RingExpert`.
    backend: grouped-matmul backend name.
  """

  chunk_rows: int | tuple[int, ...] | None = None
  max_chunk_rows: int | None = None
  backend: str = "auto"

  def __call__(self, x_TD, idx_TK, w_TK, w_gate_EDF, w_up_EDF, w_down_EFD, *, layout, activation="swiglu"):
    spec = make_ring_spec(layout, x_TD, idx_TK, w_gate_EDF, chunk_rows=self.chunk_rows, backend=self.backend,
                          activation=activation, row_cap=self.max_chunk_rows)
    ring = ring_vjp(spec, _forward_device, _backward_device)
    return ring(x_TD, idx_TK, w_TK, w_gate_EDF, w_up_EDF, w_down_EFD)
