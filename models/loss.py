"""Next-token cross-entropy from the final hidden states and the LM head, without the full logits.

`chunked_cross_entropy` equals `optax.softmax_cross_entropy_with_integer_labels(x @ head, labels)` (float32 logits)
but never holds more than one tile of them: per device, the sequence is cut into chunks of about `chunk_tokens`
tokens and the vocabulary into tiles of `vocab_tile` columns; forward keeps only each token's logsumexp (an online
max and sum over the tiles), and the custom backward recomputes a tile's logits, turns them into softmax − one-hot
and multiplies them straight into dx (accumulated in float32 over the tiles) and that tile's columns of dhead. At
Qwen3's vocabulary (151936) the full float32 logits of 65536 tokens and their gradient are 37 GiB each; a tile of
1024 tokens × 16384 columns is 64 MiB.

What moves between devices (one `shard_map`): tokens stay where they are (split over `token_axes`); the head is
gathered once at entry if FSDP splits it; with `vocab_axis` each device holds a slice of the vocabulary and the
logsumexp and the label's logit are reduced over that axis per chunk (scalars per token), dx over it once per
chunk. The head's gradient is accumulated per device and summed over the token axes once, after the last chunk.
"""

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from relaymoe_jax.grouped_matmul import matmul_precision
from relaymoe_jax.layout import vary_like

DEFAULT_CHUNK_TOKENS = 1024
DEFAULT_VOCAB_TILE = 16384


def chunked_cross_entropy(x_BSD, head_DV, labels_BS, *, mesh, token_axes, vocab_axis=None,
                          chunk_tokens=DEFAULT_CHUNK_TOKENS, vocab_tile=DEFAULT_VOCAB_TILE):
  """Per-token softmax cross-entropy of the logits x · head, in float32, chunk by chunk.

  Args:
    x_BSD: final hidden states (compute dtype), B split over `token_axes`.
    head_DV: the LM head, any float dtype (the parameter itself: it is cast to x's dtype inside, once per pass, so
      its gradient comes back in its own dtype, accumulated in float32); split over `vocab_axis` along V if given.
    labels_BS: int target ids.
    mesh: the mesh of those axes.
    token_axes: mesh axes that split B.
    vocab_axis: mesh axis that splits V of the head (tensor parallelism), or None.
    chunk_tokens: tokens per device per chunk (rounded to whole sequence positions of the local batch).
    vocab_tile: vocabulary columns per tile (of each device's slice of the vocabulary).

  Returns:
    loss_BS float32, split like x over B; differentiable in x and head.
  """
  token_axes = tuple(token_axes)
  tok = P(token_axes)

  def per_device(x_bSD, head_DVl, labels_bS):
    chunk_len = max(1, min(x_bSD.shape[1], chunk_tokens // x_bSD.shape[0]))
    tile = max(1, min(head_DVl.shape[1], vocab_tile))
    return _cross_entropy(x_bSD, head_DVl, labels_bS, (chunk_len, tile), token_axes, vocab_axis)

  return jax.shard_map(per_device, mesh=mesh, in_specs=(tok, P(None, vocab_axis), tok), out_specs=tok,
                       check_vma=True)(x_BSD, head_DV, labels_BS)


def _chunks(length, chunk_len):
  """(number of full chunks, length of the tail chunk): the tail is computed once outside the loop, so no input
  is padded (a padded copy of x would cost more than a chunk's logits at long sequences)."""
  return length // chunk_len, length % chunk_len


def _for_each_chunk(length, chunk_len, body, carry):
  """carry = body(start, size, carry) over the chunks of [0, length): a loop over the full ones, then the tail."""
  full, tail = _chunks(length, chunk_len)
  carry = jax.lax.fori_loop(0, full, lambda i, c: body(i * chunk_len, chunk_len, c), carry)
  return body(full * chunk_len, tail, carry) if tail else carry


def _chunk(a, start, size):
  return jax.lax.dynamic_slice_in_dim(a, start, size, axis=1)


def _local_logits(x_bcD, head_DVl):
  return jnp.dot(x_bcD, head_DVl, preferred_element_type=jnp.float32, precision=matmul_precision(x_bcD.dtype))


def _dx(dlogits_bcV, head_DVl):
  """dlogits · headᵀ, contracting V in place (no transposed copy of the head)."""
  return jnp.einsum("bcv,dv->bcd", dlogits_bcV, head_DVl, preferred_element_type=jnp.float32,
                    precision=matmul_precision(head_DVl.dtype))


def _vocab_offset(head_DVl, vocab_axis):
  return jax.lax.axis_index(vocab_axis) * head_DVl.shape[1] if vocab_axis else 0


def _reduce(x, op, vocab_axis):
  return op(x, vocab_axis) if vocab_axis else x


def _tile(head_DVl, start, size):
  return jax.lax.dynamic_slice_in_dim(head_DVl, start, size, axis=1)


def _is_label(labels_bc, start, size):
  """[b, c, size]: whether column `start + j` of this device's vocabulary slice is the label."""
  return (start + jnp.arange(size)) == labels_bc[..., None]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _cross_entropy(x_bSD, head_DVl, labels_bS, sizes, token_axes, vocab_axis):
  return _forward(x_bSD, head_DVl, labels_bS, sizes, token_axes, vocab_axis)[0]


def _forward(x_bSD, head_DVl, labels_bS, sizes, token_axes, vocab_axis):
  """(loss_bS, logsumexp_bS): per token, logsumexp over the vocabulary minus the label's logit."""
  chunk_len, tile = sizes
  local = _vocab_offset(head_DVl, vocab_axis)
  head_DVl = head_DVl.astype(x_bSD.dtype)
  varying = tuple(token_axes) + ((vocab_axis,) if vocab_axis else ())

  def chunk(start, size, carry):
    loss_bS, lse_bS = carry
    x_bcD = _chunk(x_bSD, start, size)
    labels_bc = _chunk(labels_bS, start, size) - local

    def add_tile(v_start, v_size, acc):
      max_bc, sum_bc, label_bc = acc
      logits_bcV = _local_logits(x_bcD, _tile(head_DVl, v_start, v_size))
      new_max_bc = jnp.maximum(max_bc, jnp.max(logits_bcV, -1))  # never differentiated: _bwd is the gradient
      sum_bc = sum_bc * jnp.exp(max_bc - new_max_bc) + jnp.sum(jnp.exp(logits_bcV - new_max_bc[..., None]), -1)
      label_bc = label_bc + jnp.sum(jnp.where(_is_label(labels_bc, v_start, v_size), logits_bcV, 0.0), -1)
      return new_max_bc, sum_bc, label_bc

    zeros_bc = vary_like(jnp.zeros(labels_bc.shape, jnp.float32), varying)
    max_bc, sum_bc, label_bc = _for_each_chunk(head_DVl.shape[1], tile, add_tile,
                                               (zeros_bc - jnp.inf, zeros_bc, zeros_bc))
    global_max_bc = _reduce(max_bc, jax.lax.pmax, vocab_axis)
    lse_bc = global_max_bc + jnp.log(_reduce(sum_bc * jnp.exp(max_bc - global_max_bc), jax.lax.psum, vocab_axis))
    label_bc = _reduce(label_bc, jax.lax.psum, vocab_axis)
    loss_bS = jax.lax.dynamic_update_slice_in_dim(loss_bS, lse_bc - label_bc, start, axis=1)
    return loss_bS, jax.lax.dynamic_update_slice_in_dim(lse_bS, lse_bc, start, axis=1)

  zeros_bS = vary_like(jnp.zeros(labels_bS.shape, jnp.float32), token_axes)
  return _for_each_chunk(x_bSD.shape[1], chunk_len, chunk, (zeros_bS, zeros_bS))


def _fwd(x_bSD, head_DVl, labels_bS, sizes, token_axes, vocab_axis):
  loss_bS, lse_bS = _forward(x_bSD, head_DVl, labels_bS, sizes, token_axes, vocab_axis)
  return loss_bS, (x_bSD, head_DVl, labels_bS, lse_bS)


def _bwd(sizes, token_axes, vocab_axis, residuals, g_bS):
  """dx and dhead from softmax − one-hot, recomputed per tile; the logits' gradient is cast to x's dtype before
  the two matmuls (float32 accumulation), as the forward's inputs are."""
  chunk_len, tile = sizes
  x_bSD, head_param_DVl, labels_bS, lse_bS = residuals
  local = _vocab_offset(head_param_DVl, vocab_axis)
  head_DVl = head_param_DVl.astype(x_bSD.dtype)
  varying = tuple(token_axes) + ((vocab_axis,) if vocab_axis else ())

  def chunk(start, size, carry):
    dx_bSD, dhead_DVl = carry
    x_bcD = _chunk(x_bSD, start, size)
    labels_bc, lse_bc, g_bc = (_chunk(a, start, size) for a in (labels_bS - local, lse_bS, g_bS))

    def add_tile(v_start, v_size, acc):
      dx_bcD, dhead_DVl = acc
      head_DVt = _tile(head_DVl, v_start, v_size)
      probs_bcV = jnp.exp(_local_logits(x_bcD, head_DVt) - lse_bc[..., None])
      dlogits_bcV = ((probs_bcV - _is_label(labels_bc, v_start, v_size)) * g_bc[..., None]).astype(x_bSD.dtype)
      dx_bcD = dx_bcD + _dx(dlogits_bcV, head_DVt)
      dhead_DVt = _tile(dhead_DVl, v_start, v_size) + jnp.einsum(
          "bcd,bcv->dv", x_bcD, dlogits_bcV, preferred_element_type=jnp.float32,
          precision=matmul_precision(x_bSD.dtype))
      return dx_bcD, jax.lax.dynamic_update_slice_in_dim(dhead_DVl, dhead_DVt, v_start, axis=1)

    dx_bcD = vary_like(jnp.zeros(x_bcD.shape, jnp.float32), varying)
    dx_bcD, dhead_DVl = _for_each_chunk(head_DVl.shape[1], tile, add_tile, (dx_bcD, dhead_DVl))
    dx_bcD = _reduce(dx_bcD, jax.lax.psum, vocab_axis)
    return jax.lax.dynamic_update_slice_in_dim(dx_bSD, dx_bcD.astype(x_bSD.dtype), start, axis=1), dhead_DVl

  dhead_DVl = vary_like(jnp.zeros(head_DVl.shape, jnp.float32), varying)
  dx_bSD, dhead_DVl = _for_each_chunk(x_bSD.shape[1], chunk_len, chunk, (jnp.zeros_like(x_bSD), dhead_DVl))
  # The head is the same on every token shard: its gradient is the sum of theirs, reduced once here.
  dhead_DVl = jax.lax.psum(dhead_DVl, token_axes)
  return dx_bSD, dhead_DVl.astype(head_param_DVl.dtype), None


_cross_entropy.defvjp(_fwd, _bwd)
