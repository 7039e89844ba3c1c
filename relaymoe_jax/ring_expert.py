"""Expert-routing ring (RelayMoE §3.1, §3.3): expert weights circulate, tokens stay.

Communication, over a ring of N devices along the expert axis (device r sends to r + 1, receives from r − 1):
  forward   hop h computes partition (r − h) mod N against the local tokens while the visiting weights
            (w_gate, w_up, w_down of L experts) are sent on for hop h + 1: N − 1 weight sends.
  backward  the weights circulate again and each hop recomputes its own intermediates. Hop 0 sends weights only;
            hops 1 … N−2 send the weights merged with the finished weight-gradient accumulator of the previous
            hop's partition; hop N−1 sends only that accumulator; a last gradient-only send returns each
            accumulator to the partition's owner: N − 1 weight sends, N gradient sends. dx and d(router weight)
            stay local. Weight gradients are then summed over the data-parallel token axes.
Nothing of size T·K·D is ever built: a hop walks its contiguous range of expert-sorted pairs in chunks of at most
R rows, with a data-dependent chunk count, so the result is dropless and padding-free under any routing skew.
"""

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from relaymoe_jax.grouped_matmul import ROW_ALIGN, expert_swiglu, max_chunk_rows
from relaymoe_jax.layout import ExpertLayout, partition_at_hop, ring_perm, vary_like, varying_zeros
from relaymoe_jax.pair_plan import (PairPlan, chunk_group_sizes, make_pair_plan, sorted_pair_weights,
                                    unsort_pair_values)

def default_chunk_rows(tokens_per_device, top_k, ring_size, row_cap=None):
  """The balanced share of one hop, ceil(T·K / N), rounded up to a multiple of 128, at most row_cap."""
  share = ROW_ALIGN * math.ceil(math.ceil(tokens_per_device * top_k / ring_size) / ROW_ALIGN)
  return min(share, row_cap) if row_cap else share


@dataclasses.dataclass(frozen=True)
class _RingSpec:
  layout: ExpertLayout
  num_experts: int
  top_k: int
  chunk_rows: int
  backend: str
  static_chunks: int | None = None  # autodiff ablation: a fixed worst-case chunk count instead of a while loop

  @property
  def experts_per_device(self):
    return self.num_experts // self.layout.ring_size


class _ChunkRows(NamedTuple):
  pos_R: jax.Array  # sorted-pair positions, clipped into range
  valid_R: jax.Array  # False past the partition's end
  sizes_L: jax.Array  # group sizes of the valid rows


def _for_each_chunk(start, count, sizes_L, chunk_rows, body, carry, static_chunks=None):
  """carry = body(rows, carry) over sorted pairs [start, start + count), chunk_rows at a time.

  The chunk count is data-dependent (a while loop), so any skew is computed without drops or padding. A while
  loop cannot be reverse-differentiated; `static_chunks` runs a fixed count instead, for the autodiff ablation.
  """
  iota_R = jnp.arange(chunk_rows, dtype=jnp.int32)

  def step(c, carry):
    offset = c * chunk_rows
    rows = _ChunkRows(
        pos_R=start + offset + iota_R,
        valid_R=offset + iota_R < count,
        sizes_L=chunk_group_sizes(sizes_L, offset, chunk_rows),
    )
    return body(rows, carry)

  if static_chunks is not None:
    return jax.lax.fori_loop(0, static_chunks, step, carry)
  return jax.lax.while_loop(lambda s: s[0] * chunk_rows < count, lambda s: (s[0] + 1, step(*s)),
                            (jnp.int32(0), carry))[1]


def _hop_range(spec, plan, h):
  r = jax.lax.axis_index(spec.layout.expert_axis)
  p = partition_at_hop(r, h, spec.layout.ring_size)
  return plan.partition(p, spec.experts_per_device)


def _clip(pos_R, num_pairs):
  return jnp.minimum(pos_R, num_pairs - 1)


def _forward_hop(spec, x_TD, plan, tok_P, w_P, acc_TD, h, weights):
  """Adds Σ w · SwiGLU over this hop's pairs into the float32 accumulator."""
  start, count, sizes_L = _hop_range(spec, plan, h)

  def chunk(rows, acc_TD):
    pos_R = _clip(rows.pos_R, tok_P.shape[0])
    tok_R = tok_P[pos_R]
    y_RD = expert_swiglu(x_TD[tok_R], *weights, rows.sizes_L, backend=spec.backend)
    y_RD = jnp.where(rows.valid_R[:, None], y_RD * w_P[pos_R].astype(jnp.float32)[:, None], 0.0)
    return acc_TD.at[tok_R].add(y_RD)

  return _for_each_chunk(start, count, sizes_L, spec.chunk_rows, chunk, acc_TD, spec.static_chunks)


def _forward_device(x_TD, idx_TK, w_TK, w_gate_LDF, w_up_LDF, w_down_LFD, *, spec):
  n, axis = spec.layout.ring_size, spec.layout.expert_axis
  plan = make_pair_plan(idx_TK, spec.num_experts)
  hop = functools.partial(_forward_hop, spec, x_TD, plan, plan.tokens(spec.top_k), sorted_pair_weights(plan, w_TK))

  def body(h, carry):
    weights, acc_TD = carry
    incoming = jax.lax.ppermute(weights, axis, ring_perm(n))  # prefetch for hop h + 1
    return incoming, hop(acc_TD, h, weights)

  acc_TD = jnp.zeros_like(x_TD, jnp.float32)
  weights, acc_TD = jax.lax.fori_loop(0, n - 1, body, ((w_gate_LDF, w_up_LDF, w_down_LFD), acc_TD))
  acc_TD = hop(acc_TD, n - 1, weights)
  return acc_TD.astype(x_TD.dtype), plan.order_P, plan.counts_E


class _Grads(NamedTuple):
  dx_TD: jax.Array  # float32
  dw_P: jax.Array  # float32, in sorted-pair order


def _backward_hop(spec, x_TD, dy_TD, plan, tok_P, w_P, grads, h, weights):
  """Recomputes this hop's intermediates chunk by chunk; returns local grads and the partition's weight grads."""
  start, count, sizes_L = _hop_range(spec, plan, h)
  token_axes = spec.layout.token_axes

  def chunk(rows, carry):
    grads, dW = carry
    pos_R = _clip(rows.pos_R, tok_P.shape[0])
    tok_R = tok_P[pos_R]
    swiglu = jax.checkpoint(lambda x, *w: expert_swiglu(x, *w, rows.sizes_L, backend=spec.backend))
    out_RD, swiglu_vjp = jax.vjp(swiglu, x_TD[tok_R], *weights)
    dy_RD = dy_TD[tok_R].astype(jnp.float32)
    valid_R1 = rows.valid_R[:, None]
    dw_R = jnp.where(rows.valid_R, jnp.sum(dy_RD * out_RD, axis=-1), 0.0)
    dx_RD, *dW_chunk = swiglu_vjp(jnp.where(valid_R1, dy_RD * w_P[pos_R].astype(jnp.float32)[:, None], 0.0))
    grads = _Grads(
        dx_TD=grads.dx_TD.at[tok_R].add(jnp.where(valid_R1, dx_RD.astype(jnp.float32), 0.0)),
        dw_P=grads.dw_P.at[pos_R].add(dw_R),
    )
    return grads, tuple(a + b.astype(jnp.float32) for a, b in zip(dW, dW_chunk))

  dW0 = tuple(varying_zeros(w.shape, jnp.float32, token_axes) for w in weights)
  return _for_each_chunk(start, count, sizes_L, spec.chunk_rows, chunk, (grads, dW0))


def _merge(acc_in, partial_f32):
  """Adds this device's partial into the relayed accumulator, in float32, stored back in the weights' dtype."""
  return tuple((a.astype(jnp.float32) + p).astype(a.dtype) for a, p in zip(acc_in, partial_f32))


def _backward_device(x_TD, w_TK, w_gate_LDF, w_up_LDF, w_down_LFD, order_P, counts_E, dy_TD, *, spec):
  n, axis = spec.layout.ring_size, spec.layout.expert_axis
  plan = PairPlan(order_P=order_P, counts_E=counts_E)
  # Varying over the data axes, so that differentiating a hop gives this device's partial weight gradient rather
  # than an implicit psum over the data axes inside a chunk loop whose trip count differs between devices.
  own = tuple(vary_like(w, spec.layout.replica_axes) for w in (w_gate_LDF, w_up_LDF, w_down_LFD))
  hop = functools.partial(_backward_hop, spec, x_TD, dy_TD, plan, plan.tokens(spec.top_k),
                          sorted_pair_weights(plan, w_TK))
  perm = ring_perm(n)
  grads = _Grads(dx_TD=jnp.zeros_like(x_TD, jnp.float32), dw_P=jnp.zeros_like(order_P, jnp.float32))

  def in_weight_dtype(partial):
    return tuple(p.astype(w.dtype) for p, w in zip(partial, own))

  if n == 1:
    grads, partial = hop(grads, 0, own)
    dW_own = in_weight_dtype(partial)
  else:
    incoming = jax.lax.ppermute(own, axis, perm)  # hop 0: weights only
    grads, partial = hop(grads, 0, own)
    acc = in_weight_dtype(partial)

    def body(h, carry):
      weights, acc_prev, grads = carry
      incoming, acc_in = jax.lax.ppermute((weights, acc_prev), axis, perm)
      grads, partial = hop(grads, h, weights)
      return incoming, _merge(acc_in, partial), grads

    weights, acc, grads = jax.lax.fori_loop(1, n - 1, body, (incoming, acc, grads))
    acc_in = jax.lax.ppermute(acc, axis, perm)  # hop N−1: gradient only
    grads, partial = hop(grads, n - 1, weights)
    dW_own = jax.lax.ppermute(_merge(acc_in, partial), axis, perm)  # home to the owner
  if spec.layout.replica_axes:
    dW_own = jax.lax.psum(dW_own, spec.layout.replica_axes)
  dw_TK = unsort_pair_values(plan, grads.dw_P, w_TK.shape).astype(w_TK.dtype)
  return (grads.dx_TD.astype(x_TD.dtype), dw_TK, *dW_own)


@functools.lru_cache(maxsize=64)
def _ring_expert_fn(spec):
  layout = spec.layout
  tok, exp = layout.token_spec, layout.expert_spec
  forward = layout.shard_map(functools.partial(_forward_device, spec=spec),
                             in_specs=(tok, tok, tok, exp, exp, exp), out_specs=(tok, tok, tok))
  backward = layout.shard_map(functools.partial(_backward_device, spec=spec),
                              in_specs=(tok, tok, exp, exp, exp, tok, tok, tok), out_specs=(tok, tok, exp, exp, exp))

  if spec.static_chunks is not None:
    return lambda *args: forward(*args)[0]

  @jax.custom_vjp
  def ring(x_TD, idx_TK, w_TK, w_gate, w_up, w_down):
    return forward(x_TD, idx_TK, w_TK, w_gate, w_up, w_down)[0]

  def ring_fwd(x_TD, idx_TK, w_TK, w_gate, w_up, w_down):
    y_TD, order_P, counts_E = forward(x_TD, idx_TK, w_TK, w_gate, w_up, w_down)
    return y_TD, (x_TD, w_TK, w_gate, w_up, w_down, order_P, counts_E)

  def ring_bwd(residuals, dy_TD):
    dx, dw_TK, dw_gate, dw_up, dw_down = backward(*residuals, layout.place(dy_TD, tok))
    return dx, None, dw_TK, dw_gate, dw_up, dw_down

  ring.defvjp(ring_fwd, ring_bwd)
  return ring


@dataclasses.dataclass(frozen=True, kw_only=True)
class RingExpert:
  """Expert-routing ring dispatcher.

  Attributes:
    chunk_rows: R, rows of one grouped-matmul chunk; default the balanced share ceil(T·K/N) rounded up to 128
      (capped for backends without a grouped kernel, see `grouped_matmul.max_chunk_rows`).
    backend: grouped-matmul backend name (see `grouped_matmul.BACKENDS`).
    recompute: True (RelayMoE): a custom backward that re-circulates the weights, recomputes each hop's
      intermediates inside the hop and relays weight gradients home. False: plain autodiff through the same ring
      forward with a fixed worst-case chunk count per hop; an ablation that keeps every hop's intermediates.
  """

  chunk_rows: int | None = None
  backend: str = "xla"
  recompute: bool = True

  def __call__(self, x_TD, idx_TK, w_TK, w_gate_EDF, w_up_EDF, w_down_EFD, *, layout):
    tokens_per_device = x_TD.shape[0] // layout.token_shards
    top_k = idx_TK.shape[1]
    num_experts, d_model, d_ff = w_gate_EDF.shape
    row_cap = max_chunk_rows(self.backend, num_experts // layout.ring_size, max(d_model, d_ff))
    chunk_rows = self.chunk_rows or default_chunk_rows(tokens_per_device, top_k, layout.ring_size, row_cap)
    if chunk_rows < 1:
      raise ValueError(f"chunk_rows={chunk_rows} must be positive")
    static_chunks = None if self.recompute else math.ceil(tokens_per_device * top_k / chunk_rows)
    spec = _RingSpec(layout=layout, num_experts=num_experts, top_k=top_k, chunk_rows=chunk_rows,
                     backend=self.backend, static_chunks=static_chunks)
    return _ring_expert_fn(spec)(x_TD, idx_TK, w_TK, w_gate_EDF, w_up_EDF, w_down_EFD)
