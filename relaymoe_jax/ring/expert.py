"""Expert-routing ring (RelayMoE §3.1, §3.3): expert weights circulate, tokens stay.

Communication, over a ring of N devices along the expert axis (device r sends to r + 1):
  forward   `ring_pass` of the weights (w_gate, w_up, w_down of L experts): hop h computes partition
            (r − h) mod N against the local tokens while the weights are sent on for hop h + 1. N − 1 weight sends.
  backward  `ring_relay`: the weights circulate again and each hop recomputes its own intermediates; the partial
            weight gradient of a partition follows its weights one hop behind, merged into the same ppermute, and
            a last gradient-only send returns it to the owner: N − 1 weight sends, N gradient sends (summed over
            a hop's chunks and relayed in the weights' dtype). dx and d(router weight) stay local. Weight
            gradients are then summed over the data-parallel token axes; under expert tensor parallelism outputs
            and dx are summed over the tensor axis.
            With `reverse_backward` (default on a ring of two) the backward is `ring_relay_homeward`: it runs
            r → r − 1 from the weights the forward ended with, so its last hop is on the device's own weights:
            N − 2 weight sends, N − 1 gradient sends, none after the last.
Shape letters: see relaymoe_jax.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from relaymoe_jax import gate_up
from relaymoe_jax.errors import UserError
from relaymoe_jax.ring.hop import backward_pairs, forward_pairs, token_side, zero_pair_grads
from relaymoe_jax.layout import vary_like, varying_zeros
from relaymoe_jax.pair_plan import PairPlan, make_pair_plan, partition_range
from relaymoe_jax.ring.schedule import ring_pass, ring_relay, ring_relay_homeward
from relaymoe_jax.ring.vjp import backward_outputs, make_ring_spec, ring_vjp


@dataclasses.dataclass(frozen=True)
class _Keeps:
  """What this ring's forward keeps for its backward beyond the inputs and the pair plan (see `RingExpert`)."""

  last_weights: bool  # reverse_backward: the forward's last payload, where the reversed backward starts
  gate_up: bool  # keep_gate_up: x·[gate | up] of every pair

  def specs(self, layout):
    last = (layout.expert_specs[0], layout.expert_specs[2]) if self.last_weights else ()
    gate_up = (P(layout.token_axes, layout.tensor_axis),) if self.gate_up else ()
    return last + gate_up


@functools.lru_cache(maxsize=None)
def _device_functions(keeps):
  """The per-device forward and backward with `keeps` bound: one pair per `_Keeps`, so `ring_vjp`'s cache holds."""
  return functools.partial(_forward_device, keeps=keeps), functools.partial(_backward_device, keeps=keeps)


def _visiting_range(spec, counts_E, partition):
  """Pairs of the local tokens whose experts are in the visiting partition."""
  return partition_range(counts_E, partition, spec.experts_per_device)


def _forward_device(x_TD, idx_TK, w_TK, w_gate_LDF, w_up_LDF, w_down_LFD, *, spec, keeps):
  layout = spec.layout
  plan = make_pair_plan(idx_TK, spec.num_experts)
  tokens = token_side(x_TD, plan, w_TK, spec.chunk_rows)

  def hop(state, partition, weights):
    acc_TD, gate_up_PU = state
    return forward_pairs(tokens, _visiting_range(spec, plan.counts_E, partition), weights, acc_TD,
                         gate_up_PU=gate_up_PU, static_chunks=spec.static_chunks, **spec.chunk_options)

  weights = (gate_up.input_weights(w_gate_LDF, w_up_LDF), w_down_LFD)
  acc_TD = varying_zeros(x_TD.shape, jnp.float32, layout.compute_axes)
  # Uninitialised (no fill of its size): every row read back is first written or masked (`backward_pairs`).
  gate_up_PU = (vary_like(jax.lax.empty((plan.order_P.shape[0], weights[0].shape[2]), x_TD.dtype),
                          layout.compute_axes) if keeps.gate_up else None)
  (acc_TD, gate_up_PU), last = ring_pass(hop, (acc_TD, gate_up_PU), weights, axis=layout.expert_axis,
                                         n=layout.ring_size)
  kept = (*(last if keeps.last_weights else ()), *((gate_up_PU,) if keeps.gate_up else ()))
  return layout.sum_tensor_partials(acc_TD).astype(x_TD.dtype), plan.order_P, plan.counts_E, *kept


def _backward_device(x_TD, w_TK, w_gate_LDF, w_up_LDF, w_down_LFD, order_P, counts_E, *kept_and_dy, spec, keeps):
  *kept, dy_TD = kept_and_dy
  gate_up_PU = kept.pop() if keeps.gate_up else None
  layout = spec.layout
  plan = PairPlan(order_P=order_P, counts_E=counts_E)
  tokens = token_side(x_TD, plan, w_TK, spec.chunk_rows)
  own = (gate_up.input_weights(w_gate_LDF, w_up_LDF), w_down_LFD)

  def hop(grads, partition, weights):
    # A hop's weight gradient is relayed in the weights' dtype, so it is summed over the hop's chunks in that dtype
    # too: a float32 sum of a bf16 model's [L, D, U] and [L, F, D] was a zero fill and a read-modify-write of
    # twice the weights' bytes per chunk, ~19% of the step's kernel time at 16384 tokens per GPU (2×H200 trace).
    return backward_pairs(tokens, dy_TD, _visiting_range(spec, counts_E, partition), weights, grads,
                          vary_axes=layout.compute_axes, gate_up_PU=gate_up_PU, **spec.chunk_options)

  def to_weight_dtype(dW):
    return tuple(d.astype(w.dtype) for d, w in zip(dW, own))

  own_v = tuple(vary_like(w, layout.compute_axes) for w in own)
  grads0 = zero_pair_grads(x_TD, order_P.shape[0], layout.compute_axes, spec.chunk_rows)
  relay = dict(axis=layout.expert_axis, n=layout.ring_size, to_relay=to_weight_dtype)
  if keeps.last_weights:  # start from the forward's last payload (device r + 1's weights), end on our own
    last = tuple(vary_like(w, layout.compute_axes) for w in kept)
    grads, (dw_gate_up, dw_down) = ring_relay_homeward(hop, grads0, last, home=own_v, **relay)
  else:
    grads, (dw_gate_up, dw_down) = ring_relay(hop, grads0, own_v, **relay)
  return backward_outputs(spec, plan, grads, dw_gate_up, dw_down, x_TD, w_TK)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RingExpert:
  """Expert-routing ring dispatcher.

  Attributes:
    chunk_rows: rows of one grouped-matmul chunk: an int R (with tail sizes R/4, R/16 added when R ≥ 4096) or a
      descending tuple, the sizes a hop's pairs are walked in (see `chunks.for_each_chunk`). Default: from 31/32 of
      the balanced share ceil(T·K/N) (capped for backends without a grouped kernel, see
      `grouped_matmul.max_chunk_rows`): one chunk and a small tail per hop when routing is balanced; on a ring of
      one, one chunk of all T·K pairs.
    max_chunk_rows: a cap on the default's largest chunk. A chunk's buffers grow with its rows, and by default
      a hop's share is one chunk, so they grow with the sequence; capped they do not (`train.plan.planner` caps them when
      memory is short; the Qwen3-30B layer at 65536 tokens on one H200 ran 18% slower capped at 131072 rows,
      docs/memory.md). Not with `chunk_rows`.
    backend: grouped-matmul backend: "auto" (Mosaic GPU kernels on Hopper, else "xla"), "xla", "mosaic_gpu",
      "kernel_reference" (see `grouped_matmul`).
    recompute: True (RelayMoE): a custom backward that re-circulates the weights, recomputes each hop's
      intermediates inside the hop and relays weight gradients home. False: plain autodiff through the same ring
      forward with a fixed worst-case chunk count per hop; an ablation that keeps every hop's intermediates.
    reverse_backward: the backward runs the ring the other way, starting from the weights the forward ended with
      (device r + 1's, kept from the forward: one more partition of weights held between forward and backward)
      and ending on the device's own: no weight send before its first hop and no gradient send after its last
      (N − 2 weight sends and N − 1 gradient sends instead of N − 1 and N), so no transfer is left exposed at
      the end of the layer's backward. None (default): on for a ring of two, where XLA keeps the forward's
      received weights for the backward anyway (so it costs no memory) and it measured 0.7–1.6 ms faster per
      Qwen3-30B layer on 2×H200 (docs/overlap.md); off for larger rings, where the kept partition is memory
      per MoE layer and the home send can overlap the next layer's backward.
    keep_gate_up: the forward keeps the input projection x·[gate | up] (a plain expert's x·W_in) of every pair
      (P × U elements per device, in x's dtype) for the backward, which then skips recomputing it: a quarter of a
      hop's backward matmul FLOPs. Memory for speed, off by default (RelayMoE keeps nothing per pair).
  """

  chunk_rows: int | tuple[int, ...] | None = None
  max_chunk_rows: int | None = None
  backend: str = "auto"
  recompute: bool = True
  reverse_backward: bool | None = None
  keep_gate_up: bool = False

  def reverses_backward(self, ring_size):
    """Whether the custom backward runs reversed on this ring (without `recompute` there is no custom backward, so
    nothing is kept from the forward for it)."""
    if not self.recompute:
      return False
    return ring_size == 2 if self.reverse_backward is None else self.reverse_backward

  def __call__(self, x_TD, idx_TK, w_TK, w_gate_EDF, w_up_EDF, w_down_EFD, *, layout, activation="swiglu"):
    if self.keep_gate_up and not self.recompute:
      raise UserError("keep_gate_up=True needs recompute=True (without it, plain autodiff keeps every intermediate)")
    spec = make_ring_spec(layout, x_TD, idx_TK, w_gate_EDF, chunk_rows=self.chunk_rows, backend=self.backend,
                          activation=activation, recompute=self.recompute, row_cap=self.max_chunk_rows)
    keeps = _Keeps(last_weights=self.reverses_backward(layout.ring_size), gate_up=self.keep_gate_up)
    ring = ring_vjp(spec, *_device_functions(keeps), keeps.specs(layout))
    return ring(x_TD, idx_TK, w_TK, w_gate_EDF, w_up_EDF, w_down_EFD)
