"""Context parallelism: one sequence spread over the 'expert' axis, and causal attention across its shards.

Layout. With N devices on 'expert', a sequence of S tokens is cut into 2N chunks of C = S / 2N; device i holds
chunks i and 2N−1−i (`balanced_order`), so every device has the same causal attention work: its early chunk sees
i + 1 chunks of keys, its late one 2N − i, 2N + 1 in all. The model permutes tokens, positions (RoPE takes each
token's place in the sequence) and labels into this order once at entry; everything but attention is per token and
does not care where a token sits, so the MoE layer, norms and the chunked loss run unchanged on each device's
tokens.

Attention (`context_attention`). Each device all-gathers K and V over 'expert' (Qwen3's grouped-query K/V is 2 KiB
a token in bfloat16) and attends each query tile to its causal prefix pair by pair: first the diagonal pair from its
own keys (masked causally), then the key tiles before it, the pairs' outputs merged by their row logsumexp; a pair
past the prefix is never computed. Backward gathers K and V again (only this device's part is kept), runs each
pair's flash-attention backward from the row's saved output and logsumexp, and sends dK and dV home with a
reduce-scatter each. A pair is attended by `TileKernels`: XLA's here (`XLA_TILES`), cuDNN's in `cudnn_attention`.
The gathered rows stay in the devices' order (a key tile is found by arithmetic), so neither the gather nor the
reduce-scatter copies a full-sequence array to reorder it. Heads stay split over 'tensor' where the K/V heads divide
over it (else every tensor device computes all heads) and batch rows over 'data'.

Packed documents (`segment_ids_BS`, non-decreasing along each row): the segment ids are gathered with K and V
(4 bytes a token), a pair is masked to its same-segment scores, and the key tiles wholly before the first document
of a query tile (in every row of the device's batch) are skipped: the loops start at the first key tile that
document reaches.

A ring of one (`tile_loop_forward`, `tile_loop_backward`) runs the same loops on one device's whole rows in sequence
order with no collective: the path of packed rows that hold more documents than cuDNN's packed layout takes
(`cudnn_documents`), where skipping other documents' key tiles beats computing every score under a bias.

Shape letters: see `relaymoe_jax`; C the tokens of one chunk, A and W the rows of a query and a key tile.
"""

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from models.attention.documents import same_document
from relaymoe_jax.axes import DATA, EXPERT, TENSOR
from relaymoe_jax.errors import UserError

# checkpoint_name of what an attention kernel's backward needs besides q, k and v (the output and its row
# logsumexp): the `all_but_attention` remat keeps them, so backward recomputes the layer but not its attention.
KERNEL_OUTPUTS = "attention_kernel_outputs"
DEFAULT_TILE = 512  # rows of a query or key tile: a tile's float32 scores are heads × 512 × 512 × 4 bytes
MIN_TILE = 64  # below this a long sequence's tile loop is all overhead


def splits_sequences(runtime, mesh):
  """Whether `runtime` splits each sequence over `mesh`'s devices: context parallelism over more than one expert
  device (over one, the sequence stays whole and in order, and attention is the usual kernel)."""
  return runtime.context_parallel and mesh.shape[EXPERT] > 1


def check_sequence(seq_len, ring):
  """Raises ValueError unless `seq_len` splits into 2 × `ring` equal chunks whose tiles are not tiny."""
  if seq_len % (2 * ring):
    raise UserError(f"context parallelism over {EXPERT}={ring} cuts each sequence into {2 * ring} chunks: "
                    f"seq_len={seq_len} is not a multiple of {2 * ring}")
  chunk = seq_len // (2 * ring)
  if tile_rows(chunk) < min(chunk, MIN_TILE):
    raise UserError(f"context parallelism over {EXPERT}={ring}: seq_len={seq_len} gives chunks of {chunk} tokens, "
                    f"whose attention tiles would be {tile_rows(chunk)} rows; use a multiple of "
                    f"{2 * ring * MIN_TILE}")


def balanced_order(seq_len, ring):
  """Sequence positions in the order the devices hold them: device i's C rows of chunk i, then of chunk 2N−1−i."""
  check_sequence(seq_len, ring)
  c = seq_len // (2 * ring)
  chunks = [chunk for i in range(ring) for chunk in (i, 2 * ring - 1 - i)]
  return np.concatenate([np.arange(chunk * c, (chunk + 1) * c) for chunk in chunks]).astype(np.int32)


def to_held_order(x_BS, ring):
  """x (any trailing dims) with axis 1 permuted from sequence order to `balanced_order`, by slices and a reversal
  (no gather: its transpose would be a scatter)."""
  b, s, *rest = x_BS.shape
  chunks = x_BS.reshape(b, 2 * ring, s // (2 * ring), *rest)
  return jnp.stack([chunks[:, :ring], chunks[:, ring:][:, ::-1]], axis=2).reshape(x_BS.shape)


def to_sequence_order(x_BS, ring):
  """The inverse of `to_held_order`."""
  b, s, *rest = x_BS.shape
  pairs = x_BS.reshape(b, ring, 2, s // (2 * ring), *rest)
  return jnp.concatenate([pairs[:, :, 0], pairs[:, ::-1, 1]], axis=1).reshape(x_BS.shape)


def key_tiles_per_device(seq_len, ring, tile):
  """How many (query tile, key tile) pairs each device computes, counted as the kernel counts them: its causal
  attention work (`tile` divides the chunk length)."""
  order = balanced_order(seq_len, ring).reshape(ring, -1)
  return [sum(int(rows[t] // tile + 1) for t in range(0, rows.size, tile)) for rows in order]  # a tile's start decides


def tile_rows(chunk, target=DEFAULT_TILE):
  """The largest divisor of a chunk's length not above `target`: tiles never straddle two chunks."""
  return max(d for d in range(1, min(chunk, target) + 1) if chunk % d == 0)


def flatten_tokens(x_BSD, mesh):
  """[B, S, D] with B over 'data' and S over 'expert' → [T, D] split over ('data', 'expert'), as the MoE block
  takes tokens, without moving one: T orders each device's rows together."""
  b, s, d = x_BSD.shape
  nd, ne = mesh.shape[DATA], mesh.shape[EXPERT]
  return x_BSD.reshape(nd, b // nd, ne, s // ne, d).swapaxes(1, 2).reshape(b * s, d)


def unflatten_tokens(x_TD, batch, seq_len, mesh):
  """The inverse of `flatten_tokens`."""
  nd, ne = mesh.shape[DATA], mesh.shape[EXPERT]
  return x_TD.reshape(nd, ne, batch // nd, seq_len // ne, -1).swapaxes(1, 2).reshape(batch, seq_len, -1)


def context_attention(q_BSQZ, k_BSJZ, v_BSJZ, *, mesh, scale, kernels=None, tile=None, segment_ids_BS=None):
  """Causal GQA attention of sequences laid out in `balanced_order` over the mesh's 'expert' axis.

  Args:
    q_BSQZ, k_BSJZ, v_BSJZ: queries, keys and values with RoPE applied, S in `balanced_order`, split over
      ('data', 'expert', 'tensor' where the heads divide over it).
    mesh: the model's mesh ('data', 'expert', 'tensor').
    scale: the score scale (head_dim^-0.5).
    kernels: the `TileKernels` that attend one (query tile, key tile) pair; `XLA_TILES` when None.
    tile: the most rows of a query or key tile (`tile_rows` of the chunk length is used); the kernels' own
      `tile` when None.
    segment_ids_BS: int, in `balanced_order` like q; a query sees only keys of its own segment. None: one.

  Returns:
    [B, S, Q, Z] in q's dtype and layout; differentiable in q, k and v.
  """
  kernels = kernels or XLA_TILES
  ring = mesh.shape[EXPERT]
  check_sequence(q_BSQZ.shape[1], ring)
  heads = TENSOR if k_BSJZ.shape[2] % mesh.shape[TENSOR] == 0 else None
  spec = P(DATA, EXPERT, heads, None)
  chunk = q_BSQZ.shape[1] // (2 * ring)
  local = functools.partial(_attention, ring=ring, scale=scale, tile=tile_rows(chunk, tile or kernels.tile),
                            kernels=kernels)
  segments_spec = None if segment_ids_BS is None else P(DATA, EXPERT)
  return jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec, segments_spec), out_specs=spec,
                       check_vma=False)(q_BSQZ, k_BSJZ, v_BSJZ, segment_ids_BS)


class TileKernels(NamedTuple):
  """Attention of one (query tile, key tile) pair, the unit the shard's loops are made of.

  forward(q_BAQZ, k_BWJZ, v_BWJZ, *, causal, scale, mask_BAW) → (o_BAQZ, lse_BQA): the pair's softmax-normalised
    output (any float dtype) and float32 row logsumexp; `causal` masks the diagonal pair (the two tiles start at the
    same position), otherwise every key is seen; `mask_BAW` (bool, or None) hides the keys a query may not see (a
    row that sees none of the pair's keys contributes nothing when merged).
  backward(q, k, v, o_BAQZ, lse_BQA, do_BAQZ, *, causal, scale, mask_BAW) → (dq, dk, dv): the flash-attention
    backward of the pair given the output and logsumexp of the whole row (so the pairs' gradients add up to the
    row's).
  """
  name: str
  forward: Callable
  backward: Callable
  tile: int  # the tile rows to aim for: small for XLA's score matrices, large for a fused kernel


def _grouped(q_AQZ, kv_heads):
  return q_AQZ.reshape(*q_AQZ.shape[:-2], kv_heads, q_AQZ.shape[-2] // kv_heads, q_AQZ.shape[-1])


def _xla_scores(q_BAJGZ, k_BWJZ, causal, scale, mask_BAW):
  """Float32 scores [B, J, G, A, W]; on the diagonal pair a key after its query is −inf, as is a masked key."""
  s = jnp.einsum("bajgz,bwjz->bjgaw", q_BAJGZ, k_BWJZ, preferred_element_type=jnp.float32) * scale
  if causal:
    s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, -jnp.inf)
  if mask_BAW is not None:
    s = jnp.where(mask_BAW[:, None, None], s, -jnp.inf)
  return s


def _xla_forward(q_BAQZ, k_BWJZ, v_BWJZ, *, causal, scale, mask_BAW=None):
  b, a, q_heads, z = q_BAQZ.shape
  s = _xla_scores(_grouped(q_BAQZ, k_BWJZ.shape[2]), k_BWJZ, causal, scale, mask_BAW)
  m = s.max(-1)  # finite where a row sees a key: always on the diagonal pair, not always with a mask
  if mask_BAW is not None:
    m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.exp(s - m[..., None])
  l = p.sum(-1)
  o = jnp.einsum("bjgaw,bwjz->bajgz", p.astype(v_BWJZ.dtype), v_BWJZ, preferred_element_type=jnp.float32)
  seen = l if mask_BAW is None else jnp.where(l > 0, l, 1.0)  # a row that sees no key: 0, and a logsumexp of −inf
  o = o / jnp.einsum("bjga->bajg", seen)[..., None]
  return o.reshape(b, a, q_heads, z), (m + jnp.log(l)).reshape(b, q_heads, a)


def _xla_backward(q_BAQZ, k_BWJZ, v_BWJZ, o_BAQZ, lse_BQA, do_BAQZ, *, causal, scale, mask_BAW=None):
  j = k_BWJZ.shape[2]
  q_BAJGZ, do_BAJGZ = _grouped(q_BAQZ, j), _grouped(do_BAQZ, j)
  f32 = dict(preferred_element_type=jnp.float32)  # products in the inputs' dtype, sums in float32
  p = jnp.exp(_xla_scores(q_BAJGZ, k_BWJZ, causal, scale, mask_BAW) - _grouped_lse(lse_BQA, j)[..., None])
  delta_BJGA = jnp.einsum("bajgz,bajgz->bjga", do_BAJGZ, _grouped(o_BAQZ, j), **f32)
  dv = jnp.einsum("bjgaw,bajgz->bwjz", p.astype(do_BAJGZ.dtype), do_BAJGZ, **f32)
  dp = jnp.einsum("bajgz,bwjz->bjgaw", do_BAJGZ, v_BWJZ, **f32)
  ds = (p * (dp - delta_BJGA[..., None]) * scale).astype(q_BAQZ.dtype)
  dq = jnp.einsum("bjgaw,bwjz->bajgz", ds, k_BWJZ, **f32).reshape(q_BAQZ.shape)
  return dq, jnp.einsum("bjgaw,bajgz->bwjz", ds, q_BAJGZ, **f32), dv


def _grouped_lse(lse_BQA, kv_heads):
  b, q_heads, a = lse_BQA.shape
  return lse_BQA.reshape(b, kv_heads, q_heads // kv_heads, a)


XLA_TILES = TileKernels(name="xla", forward=_xla_forward, backward=_xla_backward, tile=DEFAULT_TILE)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _attention(q_BSQZ, k_BSJZ, v_BSJZ, segments_BS, ring, scale, tile, kernels):
  return _forward(q_BSQZ, k_BSJZ, v_BSJZ, segments_BS, ring, scale, tile, kernels)[0]


def tile_loop_forward(q_BSQZ, k_BSJZ, v_BSJZ, segment_ids_BS, scale, tile, kernels):
  """The tile loop over whole rows on one device (a ring of one: no collective, no 'expert' axis needed), `tile`
  dividing S: (out [B, S, Q, Z], its row logsumexp [B, Q, S] float32)."""
  o_BSQZ, residuals = _forward(q_BSQZ, k_BSJZ, v_BSJZ, segment_ids_BS, 1, scale, tile, kernels)
  return o_BSQZ, residuals[-1]


def tile_loop_backward(q_BSQZ, k_BSJZ, v_BSJZ, segment_ids_BS, o_BSQZ, lse_BQS, do_BSQZ, scale, tile, kernels):
  """(dq, dk, dv) of `tile_loop_forward` given its out and logsumexp."""
  residuals = (q_BSQZ, k_BSJZ, v_BSJZ, segment_ids_BS, o_BSQZ, lse_BQS)
  return _backward_rule(1, scale, tile, kernels, residuals, do_BSQZ)[:3]


def _gather(x_BSJZ, ring):
  """Every device's rows of x, all-gathered over 'expert' in the order the devices hold them: [B, 2N·C, J, Z]."""
  return x_BSJZ if ring == 1 else jax.lax.all_gather(x_BSJZ, EXPERT, axis=1, tiled=True)


def _scatter_home(x_BSJZ, ring):
  """The inverse of `_gather` for gradients: each device gets the sum over devices of its own rows."""
  return x_BSJZ if ring == 1 else jax.lax.psum_scatter(x_BSJZ, EXPERT, scatter_dimension=1, tiled=True)


def _key_rows(x_BSJZ, w, tile, ring):
  """Key tile w (sequence positions w·tile onwards) of the gathered rows, which are in the devices' order: chunk
  m < N is device m's first, chunk m ≥ N device 2N−1−m's second (tiles never straddle chunks)."""
  return jax.lax.dynamic_slice_in_dim(x_BSJZ, _held_offset(w, tile, x_BSJZ.shape[1] // (2 * ring), ring), tile,
                                      axis=1)


def _held_offset(w, tile, chunk, ring):
  m, offset = jnp.divmod(w * tile, chunk)
  return jnp.where(m < ring, 2 * chunk * m, 2 * chunk * (2 * ring - 1 - m) + chunk) + offset


def _diagonal_tile(t, rows, tile, ring):
  """The key tile at the position of this device's query tile t: the last one its causal prefix reaches."""
  if ring == 1:  # the rows are the sequence in order, and there may be no 'expert' axis to index
    return t
  c = rows // 2
  i = jax.lax.axis_index(EXPERT)
  start = jnp.where(t * tile < c, i * c + t * tile, (2 * ring - 1 - i) * c + t * tile - c)
  return start // tile


class _Segments(NamedTuple):
  """A device's view of the packed documents: its own segment ids and every device's (gathered)."""
  own_BS: jax.Array
  all_BS: jax.Array

  def diagonal_mask(self, t, tile):
    return same_document(_rows(self.own_BS, t, tile))

  def mask(self, t, w, tile, ring):
    return _rows(self.own_BS, t, tile)[:, :, None] == _key_rows(self.all_BS, w, tile, ring)[:, None, :]

  def first_key_tile(self, t, tile, ring):
    return first_key_tile(self.all_BS, _rows(self.own_BS, t, tile)[:, 0], tile, ring)


def first_key_tile(all_BS, first_segment_B, tile, ring):
  """The first key tile that a query tile whose first tokens are in segments `first_segment_B` reaches, in every
  row (`all_BS`: every device's segment ids, in the devices' order): those before it are skipped (segment ids never
  decrease along a sequence)."""
  tiles = all_BS.shape[1] // tile
  last_BW = all_BS[:, _held_offset(jnp.arange(tiles), tile, all_BS.shape[1] // (2 * ring), ring) + tile - 1]
  return jnp.min(jnp.sum(last_BW < first_segment_B[:, None], axis=1))


def skipped_tiles(segment_ids_BS, ring, tile):
  """Per device, the (query tile, key tile) pairs of its causal prefix that the tile loop skips for these segment
  ids ([B, S] in sequence order; `tile` divides the chunk): each query tile's key tiles before `first_key_tile`.
  With `key_tiles_per_device`, what the loop computes."""
  held_BS = np.asarray(segment_ids_BS)[:, balanced_order(segment_ids_BS.shape[1], ring)]
  rows = held_BS.shape[1] // ring
  return [sum(int(first_key_tile(held_BS, held_BS[:, d * rows + t], tile, ring)) for t in range(0, rows, tile))
          for d in range(ring)]


def _segments(segments_BS, ring):
  return None if segments_BS is None else _Segments(segments_BS, _gather(segments_BS, ring))


def _forward(q_BSQZ, k_BSJZ, v_BSJZ, segments_BS, ring, scale, tile, kernels):
  """(out, residuals). Per query tile: the diagonal pair from this device's own keys (it needs no gather), then
  the key tiles before it, merged by their row logsumexp; the loops write the arrays in place, tile by tile."""
  rows = q_BSQZ.shape[1]
  k_all, v_all = _gather(k_BSJZ, ring), _gather(v_BSJZ, ring)
  segments = _segments(segments_BS, ring)
  attend = functools.partial(kernels.forward, scale=scale)

  def one_query_tile(t, outputs):
    o_BSQZ, lse_BQS = outputs
    q_BAQZ = _rows(q_BSQZ, t, tile)
    o, lse = attend(q_BAQZ, _rows(k_BSJZ, t, tile), _rows(v_BSJZ, t, tile), causal=True,
                    mask_BAW=segments and segments.diagonal_mask(t, tile))

    def one_key_tile(w, carry):
      acc_BAQZ, lse_BQA = carry
      o_w, lse_w = attend(q_BAQZ, _key_rows(k_all, w, tile, ring), _key_rows(v_all, w, tile, ring), causal=False,
                          mask_BAW=segments and segments.mask(t, w, tile, ring))
      merged = jnp.logaddexp(lse_BQA, lse_w)
      weight, weight_w = (jnp.einsum("bqa->baq", jnp.exp(x - merged))[..., None] for x in (lse_BQA, lse_w))
      return acc_BAQZ * weight + o_w.astype(jnp.float32) * weight_w, merged

    first = segments.first_key_tile(t, tile, ring) if segments else 0
    acc, lse = jax.lax.fori_loop(first, _diagonal_tile(t, rows, tile, ring), one_key_tile,
                                 (o.astype(jnp.float32), lse))
    return _put_rows(o_BSQZ, acc.astype(o_BSQZ.dtype), t), _put_rows(lse_BQS, lse, t, axis=2)

  outputs = (jnp.zeros_like(q_BSQZ), jnp.zeros((q_BSQZ.shape[0], q_BSQZ.shape[2], rows), jnp.float32))
  o_BSQZ, lse_BQS = checkpoint_name(jax.lax.fori_loop(0, rows // tile, one_query_tile, outputs), KERNEL_OUTPUTS)
  return o_BSQZ, (q_BSQZ, k_BSJZ, v_BSJZ, segments_BS, o_BSQZ, lse_BQS)


def _backward_rule(ring, scale, tile, kernels, residuals, do_BSQZ):
  """Each pair's backward from the rows' saved output and logsumexp; dK and dV (float32, over the whole
  sequence in the devices' order) go home in one reduce-scatter each."""
  q_BSQZ, k_BSJZ, v_BSJZ, segments_BS, o_BSQZ, lse_BQS = residuals
  rows = q_BSQZ.shape[1]
  k_all, v_all = _gather(k_BSJZ, ring), _gather(v_BSJZ, ring)
  segments = _segments(segments_BS, ring)
  grad = functools.partial(kernels.backward, scale=scale)

  def one_query_tile(t, carry):
    dq_BSQZ, grads_kv = carry
    q_BAQZ, o_BAQZ, do_BAQZ = (_rows(x, t, tile) for x in (q_BSQZ, o_BSQZ, do_BSQZ))
    lse_BQA = _rows(lse_BQS, t, tile, axis=2)

    def one_key_tile(w, carry, causal=False):
      dq, (dk_all, dv_all) = carry
      mask = segments and segments.mask(t, w, tile, ring)  # on the diagonal: its own keys, gathered
      dq_w, dk, dv = grad(q_BAQZ, _key_rows(k_all, w, tile, ring), _key_rows(v_all, w, tile, ring), o_BAQZ,
                          lse_BQA, do_BAQZ, causal=causal, mask_BAW=mask)
      add = functools.partial(_add_key_rows, w=w, ring=ring)
      return dq + dq_w.astype(jnp.float32), (add(dk_all, dk), add(dv_all, dv))

    diagonal = _diagonal_tile(t, rows, tile, ring)
    carry = one_key_tile(diagonal, (jnp.zeros(q_BAQZ.shape, jnp.float32), grads_kv), causal=True)
    first = segments.first_key_tile(t, tile, ring) if segments else 0
    dq, grads_kv = jax.lax.fori_loop(first, diagonal, one_key_tile, carry)
    return _put_rows(dq_BSQZ, dq.astype(dq_BSQZ.dtype), t), grads_kv

  zeros = jnp.zeros(k_all.shape, jnp.float32)
  dq_BSQZ, (dk_all, dv_all) = jax.lax.fori_loop(0, rows // tile, one_query_tile,
                                                (jnp.zeros_like(q_BSQZ), (zeros, zeros)))
  dk, dv = _scatter_home(dk_all, ring), _scatter_home(dv_all, ring)
  return dq_BSQZ, dk.astype(k_BSJZ.dtype), dv.astype(v_BSJZ.dtype), None


def _rows(x, t, tile, axis=1):
  """Tile t of x along its rows (axis 1 of a [B, S, ...] array; axis 2 of a [B, Q, S] logsumexp)."""
  return jax.lax.dynamic_slice_in_dim(x, t * tile, tile, axis=axis)


def _put_rows(x, rows, t, axis=1):
  return jax.lax.dynamic_update_slice_in_dim(x, rows, t * rows.shape[axis], axis=axis)


def _add_key_rows(x_BSJZ, rows_BWJZ, w, ring):
  tile = rows_BWJZ.shape[1]
  start = _held_offset(w, tile, x_BSJZ.shape[1] // (2 * ring), ring)
  return jax.lax.dynamic_update_slice_in_dim(
      x_BSJZ, jax.lax.dynamic_slice_in_dim(x_BSJZ, start, tile, axis=1) + rows_BWJZ.astype(x_BSJZ.dtype), start,
      axis=1)


_attention.defvjp(_forward, _backward_rule)
