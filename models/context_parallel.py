"""Context parallelism: one sequence spread over the 'expert' axis, and causal attention across its shards.

Layout. With N devices on 'expert', a sequence of S tokens is cut into 2N chunks of C = S / 2N; device i holds
chunks i and 2N−1−i (`balanced_order`), so every device has the same causal attention work: its early chunk sees
i + 1 chunks of keys, its late one 2N − i, 2N + 1 in all. The model permutes tokens, positions (RoPE takes each
token's place in the sequence) and labels into this order once at entry; everything but attention is per token and
does not care where a token sits, so the MoE layer, norms and the chunked loss run unchanged on each device's
tokens.

Attention (`context_attention`). Each device all-gathers K and V over 'expert' (Qwen3's grouped-query K/V is 2 KiB
a token in bfloat16) and attends its queries to their causal prefix tile by tile with an online softmax: a (query
tile, key tile) pair past the prefix is never computed. Backward gathers K and V again (only this device's part is
kept), recomputes each tile from the saved row logsumexp, and sends dK and dV home with a reduce-scatter each. The
gathered rows stay in the devices' order (a key tile is found by arithmetic), so neither the gather nor the
reduce-scatter copies a full-sequence array to reorder it. Heads stay split over 'tensor' where the K/V heads divide
over it (else every tensor device computes all heads) and batch rows over 'data'.

Shape letters: see `relaymoe_jax`; C the tokens of one chunk, A and W the rows of a query and a key tile.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from relaymoe_jax.axes import DATA, EXPERT, TENSOR

DEFAULT_TILE = 512  # rows of a query or key tile: a tile's float32 scores are heads × 512 × 512 × 4 bytes
MIN_TILE = 64  # below this a long sequence's tile loop is all overhead


def splits_sequences(runtime, mesh):
  """Whether `runtime` splits each sequence over `mesh`'s devices: context parallelism over more than one expert
  device (over one, the sequence stays whole and in order, and attention is the usual kernel)."""
  return runtime.context_parallel and mesh.shape[EXPERT] > 1


def check_sequence(seq_len, ring):
  """Raises ValueError unless `seq_len` splits into 2 × `ring` equal chunks whose tiles are not tiny."""
  if seq_len % (2 * ring):
    raise ValueError(f"context parallelism over {EXPERT}={ring} cuts each sequence into {2 * ring} chunks: "
                     f"seq_len={seq_len} is not a multiple of {2 * ring}")
  chunk = seq_len // (2 * ring)
  if tile_rows(chunk) < min(chunk, MIN_TILE):
    raise ValueError(f"context parallelism over {EXPERT}={ring}: seq_len={seq_len} gives chunks of {chunk} tokens, "
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
  return [sum(int(_key_tile_count(rows[t:t + tile], tile)) for t in range(0, rows.size, tile)) for rows in order]


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


def context_attention(q_BSQZ, k_BSJZ, v_BSJZ, *, mesh, scale, tile=DEFAULT_TILE):
  """Causal GQA attention of sequences laid out in `balanced_order` over the mesh's 'expert' axis.

  Args:
    q_BSQZ, k_BSJZ, v_BSJZ: queries, keys and values with RoPE applied, S in `balanced_order`, split over
      ('data', 'expert', 'tensor' where the heads divide over it).
    mesh: the model's mesh ('data', 'expert', 'tensor').
    scale: the score scale (head_dim^-0.5).
    tile: the most rows of a query or key tile (`tile_rows` of the chunk length is used).

  Returns:
    [B, S, Q, Z] in q's dtype and layout; differentiable in q, k and v.
  """
  ring = mesh.shape[EXPERT]
  check_sequence(q_BSQZ.shape[1], ring)
  heads = TENSOR if k_BSJZ.shape[2] % mesh.shape[TENSOR] == 0 else None
  spec = P(DATA, EXPERT, heads, None)
  chunk = q_BSQZ.shape[1] // (2 * ring)
  local = functools.partial(_attention, ring=ring, scale=scale, tile=tile_rows(chunk, tile))
  return jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec, check_vma=False)(
      q_BSQZ, k_BSJZ, v_BSJZ)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _attention(q_BSQZ, k_BSJZ, v_BSJZ, ring, scale, tile):
  return _forward(q_BSQZ, k_BSJZ, v_BSJZ, ring, scale, tile)[0]


def _query_positions(rows, ring):
  """Sequence positions of this device's rows (its two chunks)."""
  c = rows // 2
  i = jax.lax.axis_index(EXPERT)
  local = jnp.arange(c, dtype=jnp.int32)
  return jnp.concatenate([i * c + local, (2 * ring - 1 - i) * c + local])


def _gather(x_BSJZ):
  """Every device's rows of x, all-gathered over 'expert' in the order the devices hold them: [B, 2N·C, J, Z]."""
  return jax.lax.all_gather(x_BSJZ, EXPERT, axis=1, tiled=True)


def _scatter_home(x_BSJZ):
  """The inverse of `_gather` for gradients: each device gets the sum over devices of its own rows."""
  return jax.lax.psum_scatter(x_BSJZ, EXPERT, scatter_dimension=1, tiled=True)


def _key_rows(x_BSJZ, w, tile, ring):
  """Key tile w (sequence positions w·tile onwards) of the gathered rows, which are in the devices' order: chunk
  m < N is device m's first, chunk m ≥ N device 2N−1−m's second (tiles never straddle chunks)."""
  return jax.lax.dynamic_slice_in_dim(x_BSJZ, _held_offset(w, tile, x_BSJZ.shape[1] // (2 * ring), ring), tile,
                                      axis=1)


def _held_offset(w, tile, chunk, ring):
  m, offset = jnp.divmod(w * tile, chunk)
  return jnp.where(m < ring, 2 * chunk * m, 2 * chunk * (2 * ring - 1 - m) + chunk) + offset


def _grouped(q_AQZ, kv_heads):
  return q_AQZ.reshape(*q_AQZ.shape[:-2], kv_heads, q_AQZ.shape[-2] // kv_heads, q_AQZ.shape[-1])


def _scores(q_BAJGZ, k_BWJZ, q_pos, k_pos, scale):
  """Masked float32 scores [B, J, G, A, W] of one tile pair; a masked score is −inf."""
  s = jnp.einsum("bajgz,bwjz->bjgaw", q_BAJGZ, k_BWJZ, preferred_element_type=jnp.float32) * scale
  return jnp.where(k_pos[None, :] <= q_pos[:, None], s, -jnp.inf)


def _key_tile_count(q_pos_A, tile):
  """Key tiles the query tile's causal prefix reaches (its last row's position decides)."""
  return q_pos_A[-1] // tile + 1


def _forward(q_BSQZ, k_BSJZ, v_BSJZ, ring, scale, tile):
  """(out, residuals); the loops read and write the arrays in place, tile by tile, so nothing is held twice."""
  b, rows, _, z = q_BSQZ.shape
  j = k_BSJZ.shape[2]
  k_all, v_all = _gather(k_BSJZ), _gather(v_BSJZ)
  q_pos = _query_positions(rows, ring)
  q_BSJGZ = _grouped(q_BSQZ, j)

  def one_query_tile(t, outputs):
    o_BSJGZ, lse_BSJG = outputs
    q_BAJGZ, pos_A = _rows(q_BSJGZ, t, tile), _rows(q_pos, t, tile, axis=0)

    def one_key_tile(w, carry):
      acc, m, l = carry
      k_BWJZ, v_BWJZ = _key_rows(k_all, w, tile, ring), _key_rows(v_all, w, tile, ring)
      s = _scores(q_BAJGZ, k_BWJZ, pos_A, w * tile + jnp.arange(tile), scale)
      m_new = jnp.maximum(m, s.max(-1))  # finite from the first tile on: every row sees key 0
      p = jnp.exp(s - m_new[..., None])
      rescale = jnp.exp(m - m_new)
      acc = acc * rescale[..., None] + jnp.einsum("bjgaw,bwjz->bjgaz", p.astype(v_BWJZ.dtype), v_BWJZ,
                                                  preferred_element_type=jnp.float32)
      return acc, m_new, l * rescale + p.sum(-1)

    shape_BJGA = (b, j, q_BAJGZ.shape[3], tile)
    init = (jnp.zeros((*shape_BJGA, z), jnp.float32), jnp.full(shape_BJGA, -jnp.inf, jnp.float32),
            jnp.zeros(shape_BJGA, jnp.float32))
    acc, m, l = jax.lax.fori_loop(0, _key_tile_count(pos_A, tile), one_key_tile, init)
    o_BAJGZ = jnp.einsum("bjgaz->bajgz", acc / l[..., None]).astype(o_BSJGZ.dtype)
    return _put_rows(o_BSJGZ, o_BAJGZ, t), _put_rows(lse_BSJG, jnp.einsum("bjga->bajg", m + jnp.log(l)), t)

  outputs = (jnp.zeros_like(q_BSJGZ), jnp.zeros(q_BSJGZ.shape[:-1], jnp.float32))
  o_BSJGZ, lse_BSJG = jax.lax.fori_loop(0, rows // tile, one_query_tile, outputs)
  o_BSQZ = o_BSJGZ.reshape(q_BSQZ.shape)
  return o_BSQZ, (q_BSQZ, k_BSJZ, v_BSJZ, o_BSQZ, lse_BSJG)


def _forward_rule(q_BSQZ, k_BSJZ, v_BSJZ, ring, scale, tile):
  return _forward(q_BSQZ, k_BSJZ, v_BSJZ, ring, scale, tile)


def _backward_rule(ring, scale, tile, residuals, do_BSQZ):
  """The flash-attention backward per tile pair from the saved row logsumexp; dK and dV (float32, sequence order)
  go home in one reduce-scatter."""
  q_BSQZ, k_BSJZ, v_BSJZ, o_BSQZ, lse_BSJG = residuals
  rows, j = q_BSQZ.shape[1], k_BSJZ.shape[2]
  k_all, v_all = _gather(k_BSJZ), _gather(v_BSJZ)
  q_pos = _query_positions(rows, ring)
  q_BSJGZ, do_BSJGZ = _grouped(q_BSQZ, j), _grouped(do_BSQZ, j)
  delta_BSJG = jnp.einsum("bsjgz,bsjgz->bsjg", do_BSJGZ, _grouped(o_BSQZ, j), preferred_element_type=jnp.float32)
  f32 = dict(preferred_element_type=jnp.float32)  # products in the inputs' dtype, sums in float32

  def one_query_tile(t, carry):
    dq_BSJGZ, grads_kv = carry
    q_BAJGZ, do_BAJGZ, pos_A = _rows(q_BSJGZ, t, tile), _rows(do_BSJGZ, t, tile), _rows(q_pos, t, tile, axis=0)
    lse_BJGA, delta_BJGA = (jnp.einsum("bajg->bjga", _rows(x, t, tile)) for x in (lse_BSJG, delta_BSJG))

    def one_key_tile(w, carry):
      dq, (dk_all, dv_all) = carry
      k_BWJZ, v_BWJZ = _key_rows(k_all, w, tile, ring), _key_rows(v_all, w, tile, ring)
      p = jnp.exp(_scores(q_BAJGZ, k_BWJZ, pos_A, w * tile + jnp.arange(tile), scale) - lse_BJGA[..., None])
      dv = jnp.einsum("bjgaw,bajgz->bwjz", p.astype(do_BAJGZ.dtype), do_BAJGZ, **f32)
      dp = jnp.einsum("bajgz,bwjz->bjgaw", do_BAJGZ, v_BWJZ, **f32)
      ds = (p * (dp - delta_BJGA[..., None]) * scale).astype(q_BAJGZ.dtype)
      dq = dq + jnp.einsum("bjgaw,bwjz->bajgz", ds, k_BWJZ, **f32)
      dk = jnp.einsum("bjgaw,bajgz->bwjz", ds, q_BAJGZ, **f32)
      add = functools.partial(_add_key_rows, w=w, ring=ring)
      return dq, (add(dk_all, dk), add(dv_all, dv))

    dq, grads_kv = jax.lax.fori_loop(0, _key_tile_count(pos_A, tile), one_key_tile,
                                     (jnp.zeros(q_BAJGZ.shape, jnp.float32), grads_kv))
    return _put_rows(dq_BSJGZ, dq.astype(dq_BSJGZ.dtype), t), grads_kv

  zeros = jnp.zeros(k_all.shape, jnp.float32)
  dq_BSJGZ, (dk_all, dv_all) = jax.lax.fori_loop(0, rows // tile, one_query_tile,
                                                 (jnp.zeros_like(q_BSJGZ), (zeros, zeros)))
  dk, dv = _scatter_home(dk_all), _scatter_home(dv_all)
  return dq_BSJGZ.reshape(q_BSQZ.shape), dk.astype(k_BSJZ.dtype), dv.astype(v_BSJZ.dtype)


def _rows(x, t, tile, axis=1):
  """Tile t of x along its rows (axis 1 of a [B, S, ...] array, or axis 0 of positions)."""
  return jax.lax.dynamic_slice_in_dim(x, t * tile, tile, axis=axis)


def _put_rows(x, rows, t):
  return jax.lax.dynamic_update_slice_in_dim(x, rows, t * rows.shape[1], axis=1)


def _add_key_rows(x_BSJZ, rows_BWJZ, w, ring):
  tile = rows_BWJZ.shape[1]
  start = _held_offset(w, tile, x_BSJZ.shape[1] // (2 * ring), ring)
  return jax.lax.dynamic_update_slice_in_dim(
      x_BSJZ, jax.lax.dynamic_slice_in_dim(x_BSJZ, start, tile, axis=1) + rows_BWJZ, start, axis=1)


_attention.defvjp(_forward_rule, _backward_rule)

