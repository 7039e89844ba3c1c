"""One hop's computation, shared by both rings: the pairs of one token partition whose experts are in one weight
partition, walked in chunks of at most R rows. No communication.

A hop's pairs are a contiguous range [start, start + count) of an expert-sorted pair list (see `pair_plan`).
The chunk count is data-dependent (a `while_loop`), so any routing skew is computed with no drops and no padding.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from relaymoe_jax.grouped_matmul import expert_swiglu
from relaymoe_jax.layout import vary_like, varying_zeros
from relaymoe_jax.pair_plan import chunk_group_sizes


class TokenSide(NamedTuple):
  """The token half of a hop: rows, and for each expert-sorted pair its token index and router weight."""

  x_TD: jax.Array
  tok_P: jax.Array
  w_P: jax.Array


class PairGrads(NamedTuple):
  dx_TD: jax.Array  # float32
  dw_P: jax.Array  # float32, in sorted-pair order


def zero_pair_grads(x_TD, num_pairs, axes):
  return PairGrads(dx_TD=varying_zeros(x_TD.shape, jnp.float32, axes),
                   dw_P=varying_zeros((num_pairs,), jnp.float32, axes))


class _ChunkRows(NamedTuple):
  pos_R: jax.Array  # sorted-pair positions, clipped into the pair list
  valid_R: jax.Array  # False past the range's end
  sizes_L: jax.Array  # group sizes of the valid rows


def for_each_chunk(pairs, chunk_rows, num_pairs, body, carry, static_chunks=None):
  """carry = body(rows, carry) over the range `pairs`, chunk_rows at a time.

  A while loop cannot be reverse-differentiated; `static_chunks` runs a fixed count instead (autodiff ablation).
  """
  iota_R = jnp.arange(chunk_rows, dtype=jnp.int32)

  def step(c, carry):
    offset = c * chunk_rows
    rows = _ChunkRows(pos_R=jnp.minimum(pairs.start + offset + iota_R, num_pairs - 1),
                      valid_R=offset + iota_R < pairs.count,
                      sizes_L=chunk_group_sizes(pairs.sizes_L, offset, chunk_rows))
    return body(rows, carry)

  if static_chunks is not None:
    return jax.lax.fori_loop(0, static_chunks, step, carry)
  return jax.lax.while_loop(lambda s: s[0] * chunk_rows < pairs.count, lambda s: (s[0] + 1, step(*s)),
                            (jnp.int32(0), carry))[1]


def forward_pairs(tokens, pairs, weights, acc_TD, *, chunk_rows, backend, static_chunks=None):
  """acc_TD (float32) += Σ over the range's pairs of w · SwiGLU_expert(x)."""

  def chunk(rows, acc_TD):
    tok_R = tokens.tok_P[rows.pos_R]
    y_RD = expert_swiglu(tokens.x_TD[tok_R], *weights, rows.sizes_L, backend=backend)
    y_RD = jnp.where(rows.valid_R[:, None], y_RD * tokens.w_P[rows.pos_R].astype(jnp.float32)[:, None], 0.0)
    return acc_TD.at[tok_R].add(y_RD)

  return for_each_chunk(pairs, chunk_rows, tokens.tok_P.shape[0], chunk, acc_TD, static_chunks)


def backward_pairs(tokens, dy_TD, pairs, weights, grads, dW, *, chunk_rows, backend, vary_axes):
  """Recomputes the range's intermediates chunk by chunk and adds the gradients: dx and d(router weight) into
  `grads`, the weights' gradients (float32) into `dW`.

  Rows and weights are first cast to varying over `vary_axes` (every axis the outputs vary over): differentiating
  a chunk with an input invariant over some axis would make JAX psum its cotangent over that axis inside this
  data-dependent loop, which deadlocks when trip counts differ between devices and double-counts otherwise.
  """
  weights = tuple(vary_like(w, vary_axes) for w in weights)

  def chunk(rows, carry):
    grads, dW = carry
    tok_R = tokens.tok_P[rows.pos_R]
    swiglu = jax.checkpoint(lambda x, *w: expert_swiglu(x, *w, rows.sizes_L, backend=backend))
    out_RD, swiglu_vjp = jax.vjp(swiglu, vary_like(tokens.x_TD[tok_R], vary_axes), *weights)
    dy_RD = dy_TD[tok_R].astype(jnp.float32)
    valid_R1 = rows.valid_R[:, None]
    dw_R = jnp.where(rows.valid_R, jnp.sum(dy_RD * out_RD, axis=-1), 0.0)
    d_out_RD = jnp.where(valid_R1, dy_RD * tokens.w_P[rows.pos_R].astype(jnp.float32)[:, None], 0.0)
    dx_RD, *dW_chunk = swiglu_vjp(vary_like(d_out_RD, vary_axes))
    grads = PairGrads(dx_TD=grads.dx_TD.at[tok_R].add(jnp.where(valid_R1, dx_RD.astype(jnp.float32), 0.0)),
                      dw_P=grads.dw_P.at[rows.pos_R].add(dw_R))
    return grads, tuple(a + b.astype(jnp.float32) for a, b in zip(dW, dW_chunk))

  return for_each_chunk(pairs, chunk_rows, tokens.tok_P.shape[0], chunk, (grads, dW))
