"""One hop's computation, shared by both rings: the pairs of one token partition whose experts are in one weight
partition, walked in chunks whose sizes come from a ladder (`chunks.for_each_chunk`). No communication.

A hop's pairs are a contiguous range [start, start + count) of an expert-sorted pair list (see `pair_plan`).
Shape letters: see relaymoe_jax.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from relaymoe_jax.ring.chunks import chunk_at, for_each_chunk, level_runs
from relaymoe_jax.kernels.grouped_matmul import expert_mlp, expert_mlp_backward
from relaymoe_jax.layout import vary_like, varying_zeros
from relaymoe_jax.pair_plan import sorted_pair_weights

# A chunk of at least this many rows per token adds its rows to their tokens by a gather: each token reads its K
# sorted positions and sums the rows that are in the chunk (the rest all read row 0, which stays cached), in
# float32, with no atomics. Smaller chunks scatter-add their rows, since the gather costs a pass over all T·K
# positions and the [T, D] accumulator whatever the chunk's size. On one H200 (Qwen3-30B layer, 65536 tokens,
# `moe_layer` run 20 in benchmarks/results/RUNS.md) the ring of one's two scatter-adds took 6.8 ms a step and their
# gathers 1.3; a ladder of 4·T-row chunks (an EP 2 hop's) ran 3.6 ms faster by gather, one of 2·T rows 2.7 ms.
GATHER_MIN_ROWS_PER_TOKEN = 2


def adds_by_gather(rows, num_tokens):
  return rows >= GATHER_MIN_ROWS_PER_TOKEN * num_tokens


class TokenSide(NamedTuple):
  """The token half of a hop: rows, and for each expert-sorted pair its token index and router weight; `pos_TK`,
  the sorted position of each token's pairs, where a chunk adds its rows by gather (else None)."""

  x_TD: jax.Array
  tok_P: jax.Array
  w_P: jax.Array
  pos_TK: jax.Array | None = None


def token_side(x_TD, plan, w_TK, chunk_rows=()):
  """This device's token half, for hops walked in chunks of `chunk_rows` (see `with_token_positions`)."""
  tokens = TokenSide(x_TD, plan.tokens(w_TK.shape[1]), sorted_pair_weights(plan, w_TK))
  return with_token_positions(tokens, chunk_rows, w_TK.shape[1])


def with_token_positions(tokens, chunk_rows, top_k):
  """`tokens` with `pos_TK` where a chunk of `chunk_rows` adds its rows by gather. Found from the pairs' token ids
  alone (a stable sort groups each token's K positions), so a token partition that travels need not carry them."""
  num_tokens = tokens.x_TD.shape[0]
  if not any(adds_by_gather(rows, num_tokens) for rows in chunk_rows):
    return tokens
  pos_TK = jnp.argsort(tokens.tok_P, stable=True).astype(jnp.int32).reshape(num_tokens, top_k)
  return tokens._replace(pos_TK=pos_TK)


class PairGrads(NamedTuple):
  dx_TD: jax.Array  # float32
  dw_P: jax.Array  # float32, in sorted-pair order, then max(chunk_rows) of padding (see `backward_pairs`)

  def pair_weight_grads(self, num_pairs):
    return self.dw_P[:num_pairs]


def zero_pair_grads(x_TD, num_pairs, axes, chunk_rows):
  return PairGrads(dx_TD=varying_zeros(x_TD.shape, jnp.float32, axes),
                   dw_P=varying_zeros((num_pairs + max(chunk_rows),), jnp.float32, axes))


def _add_to_tokens(acc_TD, v_RD, rows, tokens, weighted=False):
  """acc_TD (float32) += each row of the chunk before the range's end (times its router weight if `weighted`) at
  its token: by gather where the chunk is large (see `GATHER_MIN_ROWS_PER_TOKEN`), else by scatter-add."""
  if tokens.pos_TK is None or not adds_by_gather(v_RD.shape[0], acc_TD.shape[0]):
    if weighted:
      v_RD = v_RD.astype(jnp.float32) * tokens.w_P[rows.pos_R].astype(jnp.float32)[:, None]
    return acc_TD.at[tokens.tok_P[rows.pos_R]].add(jnp.where(rows.valid_R[:, None], v_RD, 0.0))
  rel_TK = tokens.pos_TK - rows.first
  in_TK = (rel_TK >= 0) & (rel_TK < rows.count)
  v_TKD = v_RD[jnp.where(in_TK, rel_TK, 0)].astype(jnp.float32)
  if weighted:
    v_TKD = v_TKD * tokens.w_P[tokens.pos_TK].astype(jnp.float32)[..., None]
  return acc_TD + jnp.sum(jnp.where(in_TK[..., None], v_TKD, 0.0), axis=1)


def forward_pairs(tokens, pairs, weights, acc_TD, *, chunk_rows, backend, activation, static_chunks=None,
                  gate_up_PU=None):
  """acc_TD (float32) += Σ over the range's pairs of w · expert(x) (`grouped_matmul.expert_mlp`).

  `gate_up_PU`: a [P, U] buffer of the input projection x·W_in ([gate | up]) in sorted-pair order that the range's
  pairs are also written into, for a backward that keeps them (None: not kept).

  Returns:
    (acc_TD, gate_up_PU).
  """

  def chunk(rows, carry):
    acc_TD, kept_PU = carry
    y_RD, gate_up_RU = expert_mlp(tokens.x_TD[tokens.tok_P[rows.pos_R]], *weights, rows.sizes_L, backend=backend,
                                  activation=activation, keep_gate_up=kept_PU is not None)
    if kept_PU is not None:  # rows past the range are other ranges' (or past P): dropped, each its own index
      to_R = jnp.where(rows.valid_R, rows.pos_R, kept_PU.shape[0] + jnp.arange(rows.pos_R.shape[0]))
      kept_PU = kept_PU.at[to_R].set(gate_up_RU.astype(kept_PU.dtype), mode="drop", unique_indices=True)
    return _add_to_tokens(acc_TD, y_RD, rows, tokens, weighted=True), kept_PU

  return for_each_chunk(pairs, chunk_rows, tokens.tok_P.shape[0], chunk, (acc_TD, gate_up_PU), static_chunks)


def backward_pairs(tokens, dy_TD, pairs, weights, grads, dW=None, *, chunk_rows, backend, activation, vary_axes,
                   gate_up_PU=None):
  """Recomputes the range's intermediates chunk by chunk and adds the gradients: dx and d(router weight) into
  `grads`, the weights' gradients into `dW` (each chunk's added in float32 and kept in dW's dtype).

  `dW=None`: the range's own weight gradients, in the weights' dtype, begun from its first chunk where the range
  fills one (a balanced hop's), not from zeros: per hop, a zero fill and an add of the weights' size fewer.
  `gate_up_PU`: the forward's input projection (see `forward_pairs`), read instead of recomputed.

  Rows and weights are first cast to varying over `vary_axes` (every axis the outputs vary over): differentiating
  a chunk with an input invariant over some axis would make JAX psum its cotangent over that axis inside this
  data-dependent loop, which deadlocks when trip counts differ between devices and double-counts otherwise.
  """
  weights = tuple(vary_like(w, vary_axes) for w in weights)
  num_pairs = tokens.tok_P.shape[0]

  def chunk_grads(rows, grads):
    tok_R = tokens.tok_P[rows.pos_R]
    valid_R1 = rows.valid_R[:, None]
    w_R = vary_like(jnp.where(rows.valid_R, tokens.w_P[rows.pos_R].astype(jnp.float32), 0.0), vary_axes)
    # Rows past the range may be another range's or never written (pairs of no expert): zeros, not garbage.
    kept_RU = None if gate_up_PU is None else jnp.where(valid_R1, gate_up_PU[rows.pos_R], 0)
    dy_RD = jnp.where(valid_R1, dy_TD[tok_R], jnp.zeros((), dy_TD.dtype))
    dx_RD, dw_R, *dW_chunk = expert_mlp_backward(
        vary_like(tokens.x_TD[tok_R], vary_axes), *weights, rows.sizes_L, vary_like(dy_RD, vary_axes), w_R,
        activation=activation, backend=backend, gate_up_RU=kept_RU)
    # A chunk's pairs are consecutive sorted positions, so d(router weight) is a slice update, not a scatter
    # (XLA fuses a scatter with the row reduction into one thread per row); dw_P's padding keeps the slice whole.
    dw_R = jax.lax.dynamic_slice_in_dim(grads.dw_P, rows.first, dw_R.shape[0]) + jnp.where(rows.valid_R, dw_R, 0.0)
    grads = PairGrads(dx_TD=_add_to_tokens(grads.dx_TD, dx_RD, rows, tokens),
                      dw_P=jax.lax.dynamic_update_slice_in_dim(grads.dw_P, dw_R, rows.first, 0))
    return grads, dW_chunk

  def chunk(rows, carry):
    grads, dW = carry
    grads, dW_chunk = chunk_grads(rows, grads)
    return grads, tuple((a.astype(jnp.float32) + b).astype(a.dtype) for a, b in zip(dW, dW_chunk))

  if dW is not None:
    return for_each_chunk(pairs, chunk_rows, num_pairs, chunk, (grads, dW))

  def first_chunk(grads):
    grads, dW_chunk = chunk_grads(chunk_at(pairs, 0, chunk_rows[0], num_pairs), grads)
    return jnp.int32(chunk_rows[0]), (grads, tuple(d.astype(w.dtype) for d, w in zip(dW_chunk, weights)))

  def from_zeros(grads):
    return jnp.int32(0), (grads, tuple(varying_zeros(w.shape, w.dtype, vary_axes) for w in weights))

  offset, carry = jax.lax.cond(level_runs(chunk_rows, 0, 0, pairs.count), first_chunk, from_zeros, grads)
  return for_each_chunk(pairs, chunk_rows, num_pairs, chunk, carry, offset=offset)
