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

Shape letters: see `relaymoe_jax`; inside the `shard_map` each array is this device's part (B its sequences, V its
slice of the vocabulary or one tile of it), and R the positions of one chunk.
"""

import functools

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from relaymoe_jax.kernels.grouped_matmul import matmul_precision
from relaymoe_jax.layout import vary_like

DEFAULT_CHUNK_TOKENS = 1024
DEFAULT_VOCAB_TILE = 16384


def chunked_cross_entropy(x_BSD, head_DV, labels_BS, *, mesh, token_axes, sequence_axis=None, vocab_axis=None,
                          chunk_tokens=DEFAULT_CHUNK_TOKENS, vocab_tile=DEFAULT_VOCAB_TILE):
  """Per-token softmax cross-entropy of the logits x · head, in float32, chunk by chunk.

  Args:
    x_BSD: final hidden states (compute dtype), B split over `token_axes`.
    head_DV: the LM head, any float dtype (the parameter itself: it is cast to x's dtype inside, once per pass, so
      its gradient comes back in its own dtype, accumulated in float32); split over `vocab_axis` along V if given.
    labels_BS: int target ids.
    mesh: the mesh of those axes.
    token_axes: mesh axes that split B.
    sequence_axis: mesh axis that splits S (context parallelism: every token is scored where it is), or None.
    vocab_axis: mesh axis that splits V of the head (tensor parallelism), or None.
    chunk_tokens: tokens per device per chunk (rounded to whole sequence positions of the local batch).
    vocab_tile: vocabulary columns per tile (of each device's slice of the vocabulary).

  Returns:
    loss_BS float32, split like x over B; differentiable in x and head.
  """
  tok = P(tuple(token_axes), sequence_axis)
  split_axes = tuple(token_axes) + ((sequence_axis,) if sequence_axis else ())

  def per_device(x_BSD, head_DV, labels_BS):
    sizes = (_chunk_len(x_BSD, chunk_tokens), _tile_len(head_DV, vocab_tile))
    return _cross_entropy(x_BSD, head_DV, labels_BS, sizes, split_axes, vocab_axis)

  return jax.shard_map(per_device, mesh=mesh, in_specs=(tok, P(None, vocab_axis), tok), out_specs=tok,
                       check_vma=True)(x_BSD, head_DV, labels_BS)


def mean_cross_entropy(x_BSD, head_DV, labels_BS, *, mesh, token_axes, sequence_axis=None, vocab_axis=None,
                       chunk_tokens=DEFAULT_CHUNK_TOKENS, vocab_tile=DEFAULT_VOCAB_TILE, weights_BS=None):
  """`chunked_cross_entropy(...).mean()`, a float32 scalar, for a loss that ends in it (the trainer's): its
  gradient is computed in the forward pass, so the logits are computed once, not again in the backward.
  With `weights_BS` (float32, 0 or 1 per target, split like the labels) the mean over the counted targets,
  Σ w · loss / max(Σ w, 1): a target of weight 0 adds nothing to the loss or its gradient.

  Differentiated, each chunk of about `chunk_tokens` tokens per device takes its logits over the device's whole
  vocabulary at once ([chunk, V] in float32: the chunk size bounds them), their logsumexp, softmax − one-hot
  scaled by 1 / the number of tokens, cast to x's dtype, and from that the chunk's dx and its share of dhead
  (accumulated in float32): three matmuls per chunk. The backward only scales the stored dx and dhead by the
  incoming cotangent. Not differentiated, it is the per-token forward (vocabulary tiles of `vocab_tile`) summed.
  Arguments as `chunked_cross_entropy`'s.
  """
  tok = P(tuple(token_axes), sequence_axis)
  split_axes = tuple(token_axes) + ((sequence_axis,) if sequence_axis else ())
  count = x_BSD.shape[0] * x_BSD.shape[1]

  def per_device(x_BSD, head_DV, labels_BS, weights_BS):
    sizes = (_chunk_len(x_BSD, chunk_tokens), _tile_len(head_DV, vocab_tile), count)
    return _mean_cross_entropy(x_BSD, head_DV, labels_BS, weights_BS, sizes, split_axes, vocab_axis)

  return jax.shard_map(per_device, mesh=mesh, in_specs=(tok, P(None, vocab_axis), tok, tok), out_specs=P(),
                       check_vma=True)(x_BSD, head_DV, labels_BS, weights_BS)


def _chunk_len(x_BSD, chunk_tokens):
  """Positions of the local batch per chunk: about `chunk_tokens` tokens."""
  return max(1, min(x_BSD.shape[1], chunk_tokens // x_BSD.shape[0]))


def _tile_len(head_DV, vocab_tile):
  return max(1, min(head_DV.shape[1], vocab_tile))


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


def _local_logits(x_BRD, head_DV):
  return jnp.dot(x_BRD, head_DV, preferred_element_type=jnp.float32, precision=matmul_precision(x_BRD.dtype))


def _dx(dlogits_BRV, head_DV):
  """dlogits · headᵀ, contracting V in place (no transposed copy of the head)."""
  return jnp.einsum("BRV,DV->BRD", dlogits_BRV, head_DV, preferred_element_type=jnp.float32,
                    precision=matmul_precision(head_DV.dtype))


def _dhead(x_BRD, dlogits_BRV):
  return jnp.einsum("BRD,BRV->DV", x_BRD, dlogits_BRV, preferred_element_type=jnp.float32,
                    precision=matmul_precision(x_BRD.dtype))


def _vocab_offset(head_DV, vocab_axis):
  return jax.lax.axis_index(vocab_axis) * head_DV.shape[1] if vocab_axis else 0


def _reduce(x, op, vocab_axis):
  return op(x, vocab_axis) if vocab_axis else x


def _tile(head_DV, start, size):
  return jax.lax.dynamic_slice_in_dim(head_DV, start, size, axis=1)


def _is_label(labels_BR, start, size):
  """[b, c, size]: whether column `start + j` of this device's vocabulary slice is the label."""
  return (start + jnp.arange(size)) == labels_BR[..., None]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _cross_entropy(x_BSD, head_DV, labels_BS, sizes, token_axes, vocab_axis):
  return _forward(x_BSD, head_DV, labels_BS, sizes, token_axes, vocab_axis)[0]


def _forward(x_BSD, head_DV, labels_BS, sizes, token_axes, vocab_axis):
  """(loss_BS, logsumexp_BS): per token, logsumexp over the vocabulary minus the label's logit."""
  chunk_len, tile = sizes
  local = _vocab_offset(head_DV, vocab_axis)
  head_DV = head_DV.astype(x_BSD.dtype)
  varying = tuple(token_axes) + ((vocab_axis,) if vocab_axis else ())

  def chunk(start, size, carry):
    loss_BS, lse_BS = carry
    x_BRD = _chunk(x_BSD, start, size)
    labels_BR = _chunk(labels_BS, start, size) - local

    def add_tile(v_start, v_size, acc):
      max_BR, sum_BR, label_BR = acc
      logits_BRV = _local_logits(x_BRD, _tile(head_DV, v_start, v_size))
      new_max_BR = jnp.maximum(max_BR, jnp.max(logits_BRV, -1))  # never differentiated: _bwd is the gradient
      sum_BR = sum_BR * jnp.exp(max_BR - new_max_BR) + jnp.sum(jnp.exp(logits_BRV - new_max_BR[..., None]), -1)
      label_BR = label_BR + jnp.sum(jnp.where(_is_label(labels_BR, v_start, v_size), logits_BRV, 0.0), -1)
      return new_max_BR, sum_BR, label_BR

    zeros_BR = vary_like(jnp.zeros(labels_BR.shape, jnp.float32), varying)
    max_BR, sum_BR, label_BR = _for_each_chunk(head_DV.shape[1], tile, add_tile,
                                               (zeros_BR - jnp.inf, zeros_BR, zeros_BR))
    global_max_BR = _reduce(max_BR, jax.lax.pmax, vocab_axis)
    lse_BR = global_max_BR + jnp.log(_reduce(sum_BR * jnp.exp(max_BR - global_max_BR), jax.lax.psum, vocab_axis))
    label_BR = _reduce(label_BR, jax.lax.psum, vocab_axis)
    loss_BS = jax.lax.dynamic_update_slice_in_dim(loss_BS, lse_BR - label_BR, start, axis=1)
    return loss_BS, jax.lax.dynamic_update_slice_in_dim(lse_BS, lse_BR, start, axis=1)

  zeros_BS = vary_like(jnp.zeros(labels_BS.shape, jnp.float32), token_axes)
  return _for_each_chunk(x_BSD.shape[1], chunk_len, chunk, (zeros_BS, zeros_BS))


def _fwd(x_BSD, head_DV, labels_BS, sizes, token_axes, vocab_axis):
  loss_BS, lse_BS = _forward(x_BSD, head_DV, labels_BS, sizes, token_axes, vocab_axis)
  return loss_BS, (x_BSD, head_DV, labels_BS, lse_BS)


def _bwd(sizes, token_axes, vocab_axis, residuals, g_BS):
  """dx and dhead from softmax − one-hot, recomputed per tile; the logits' gradient is cast to x's dtype before
  the two matmuls (float32 accumulation), as the forward's inputs are."""
  chunk_len, tile = sizes
  x_BSD, head_param_DV, labels_BS, lse_BS = residuals
  local = _vocab_offset(head_param_DV, vocab_axis)
  head_DV = head_param_DV.astype(x_BSD.dtype)
  varying = tuple(token_axes) + ((vocab_axis,) if vocab_axis else ())

  def chunk(start, size, carry):
    dx_BSD, dhead_DV = carry
    x_BRD = _chunk(x_BSD, start, size)
    labels_BR, lse_BR, g_BR = (_chunk(a, start, size) for a in (labels_BS - local, lse_BS, g_BS))

    def add_tile(v_start, v_size, acc):
      dx_BRD, dhead_DV = acc
      tile_DV = _tile(head_DV, v_start, v_size)
      probs_BRV = jnp.exp(_local_logits(x_BRD, tile_DV) - lse_BR[..., None])
      dlogits_BRV = ((probs_BRV - _is_label(labels_BR, v_start, v_size)) * g_BR[..., None]).astype(x_BSD.dtype)
      dx_BRD = dx_BRD + _dx(dlogits_BRV, tile_DV)
      dtile_DV = _tile(dhead_DV, v_start, v_size) + _dhead(x_BRD, dlogits_BRV)
      return dx_BRD, jax.lax.dynamic_update_slice_in_dim(dhead_DV, dtile_DV, v_start, axis=1)

    dx_BRD = vary_like(jnp.zeros(x_BRD.shape, jnp.float32), varying)
    dx_BRD, dhead_DV = _for_each_chunk(head_DV.shape[1], tile, add_tile, (dx_BRD, dhead_DV))
    dx_BRD = _reduce(dx_BRD, jax.lax.psum, vocab_axis)
    return jax.lax.dynamic_update_slice_in_dim(dx_BSD, dx_BRD.astype(x_BSD.dtype), start, axis=1), dhead_DV

  dhead_DV = vary_like(jnp.zeros(head_DV.shape, jnp.float32), varying)
  dx_BSD, dhead_DV = _for_each_chunk(x_BSD.shape[1], chunk_len, chunk, (jnp.zeros_like(x_BSD), dhead_DV))
  # The head is the same on every token shard: its gradient is the sum of theirs, reduced once here.
  dhead_DV = jax.lax.psum(dhead_DV, token_axes)
  return dx_BSD, dhead_DV.astype(head_param_DV.dtype), None


_cross_entropy.defvjp(_fwd, _bwd)


def _count(weights_BS, sizes, token_axes):
  """The targets the mean is over: all of them (static), or the weights' sum over every device."""
  if weights_BS is None:
    return sizes[2]
  return jnp.maximum(jax.lax.psum(jnp.sum(weights_BS), token_axes), 1.0)


def _weighted(loss_BR, weights_BR):
  return loss_BR if weights_BR is None else loss_BR * weights_BR


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _mean_cross_entropy(x_BSD, head_DV, labels_BS, weights_BS, sizes, token_axes, vocab_axis):
  chunk_len, tile, _ = sizes
  loss_BS = _forward(x_BSD, head_DV, labels_BS, (chunk_len, tile), token_axes, vocab_axis)[0]
  return jax.lax.psum(jnp.sum(_weighted(loss_BS, weights_BS)), token_axes) / _count(weights_BS, sizes, token_axes)


def _mean_fwd(x_BSD, head_param_DV, labels_BS, weights_BS, sizes, token_axes, vocab_axis):
  """(mean loss, (dx, dhead) of the mean), chunk by chunk over the whole vocabulary slice: one logits matmul."""
  chunk_len = sizes[0]
  count = _count(weights_BS, sizes, token_axes)
  local = _vocab_offset(head_param_DV, vocab_axis)
  head_DV = head_param_DV.astype(x_BSD.dtype)
  varying = tuple(token_axes) + ((vocab_axis,) if vocab_axis else ())

  def chunk(start, size, carry):
    loss, dx_BSD, dhead_DV = carry
    x_BRD = _chunk(x_BSD, start, size)
    labels_BR = _chunk(labels_BS, start, size) - local
    weights_BR = None if weights_BS is None else _chunk(weights_BS, start, size)
    logits_BRV = _local_logits(x_BRD, head_DV)
    max_BR = _reduce(jnp.max(logits_BRV, -1), jax.lax.pmax, vocab_axis)
    lse_BR = max_BR + jnp.log(_reduce(jnp.sum(jnp.exp(logits_BRV - max_BR[..., None]), -1), jax.lax.psum,
                                      vocab_axis))
    loss_BR = lse_BR - _reduce(_label_logit(logits_BRV, labels_BR), jax.lax.psum, vocab_axis)
    loss = loss + jnp.sum(_weighted(loss_BR, weights_BR))
    probs_BRV = jnp.exp(logits_BRV - lse_BR[..., None])
    dlogits_BRV = jnp.where(_is_label(labels_BR, 0, probs_BRV.shape[-1]), probs_BRV - 1, probs_BRV)
    if weights_BR is not None:
      dlogits_BRV = dlogits_BRV * weights_BR[..., None]
    dlogits_BRV = (dlogits_BRV / count).astype(x_BSD.dtype)
    dx_BRD = _reduce(_dx(dlogits_BRV, head_DV), jax.lax.psum, vocab_axis).astype(x_BSD.dtype)
    dhead_DV = dhead_DV + _dhead(x_BRD, dlogits_BRV)
    return loss, jax.lax.dynamic_update_slice_in_dim(dx_BSD, dx_BRD, start, axis=1), dhead_DV

  zero = vary_like(jnp.zeros((), jnp.float32), token_axes)
  dhead_DV = vary_like(jnp.zeros(head_DV.shape, jnp.float32), varying)
  loss, dx_BSD, dhead_DV = _for_each_chunk(x_BSD.shape[1], chunk_len, chunk, (zero, jnp.zeros_like(x_BSD), dhead_DV))
  # The head is the same on every token shard: its gradient is the sum of theirs, reduced once here.
  dhead_DV = jax.lax.psum(dhead_DV, token_axes).astype(head_param_DV.dtype)
  return jax.lax.psum(loss, token_axes) / count, (dx_BSD, dhead_DV)


def _mean_bwd(sizes, token_axes, vocab_axis, residuals, g):
  dx_BSD, dhead_DV = residuals
  return dx_BSD * g.astype(dx_BSD.dtype), dhead_DV * g.astype(dhead_DV.dtype), None, None


_mean_cross_entropy.defvjp(_mean_fwd, _mean_bwd)


def _label_logit(logits_BRV, labels_BR):
  """The label's logit, 0 where the label is outside this device's vocabulary slice: a gather, not a pass over V."""
  inside_BR = (labels_BR >= 0) & (labels_BR < logits_BRV.shape[-1])
  picked_BR = jnp.take_along_axis(logits_BRV, jnp.clip(labels_BR, 0, logits_BRV.shape[-1] - 1)[..., None], -1)
  return jnp.where(inside_BR, picked_BR[..., 0], 0.0)


def plain_mean_cross_entropy(logits_BSV, labels_BS, weights_BS=None):
  """The mean cross-entropy over the counted targets, from full logits (`loss_chunk_tokens=0`)."""
  return mean_over_targets(optax.softmax_cross_entropy_with_integer_labels(logits_BSV, labels_BS), weights_BS)


def mean_over_targets(ce_BS, weights_BS=None):
  """The mean of per-target losses over the counted targets (`weights_BS`, 0 or 1 each; None: all)."""
  return ce_BS.mean() if weights_BS is None else jnp.sum(ce_BS * weights_BS) / jnp.maximum(jnp.sum(weights_BS), 1)
