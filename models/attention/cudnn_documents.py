"""Packed documents on cuDNN flash attention without context parallelism: each document attended as its own sequence.

Given the same-document mask, cuDNN (through `jax.nn.dot_product_attention`) adds it as a bias [B, 1, S, S] and runs
its biased kernel at half the causal kernel's speed. Its packed layout instead takes each row's document offsets and
lengths ([B, M+1] and [B, M], M a static bound on the documents in a row: `runtime.documents_per_row`), so each
document is a causal sequence of its own and nothing a document cannot see is computed. One H200, the 30B shape's
heads, 16 × 4096, documents of mean 1024 tokens (7 at most in a row), forward and backward (`benchmarks.cp_attention`,
`documents_attention.txt`): causal without documents 15.9 ms, bias 33.3, packed with M = 16 11.3, but cuDNN's packed
backward takes float32 temporaries for every slot of every row a call holds: 32.3 GiB at M = 16 (2.0 without
documents). `rows` bounds the rows a call holds (calls one after another, contiguous groups of one device's rows): a
row at a time 16.1 ms and 2.3 GiB. `documents_attention_on` runs it on each device's rows of a mesh, as many a call as
`rows_per_call` allows.

A call in which some row holds more than M documents takes context parallelism's tile loop over one device instead
(`lax.cond`, per call; cuDNN's tiles of `long_row_tile` rows, 2048 in a long row), so the result is exact either way:
a query tile skips the key tiles before its first document and masks the rest. Such a call used to take the mask as
a bias over the whole row, computing every causal score: on one H200 (JAX 0.11.2, `documents_long_rows.txt`), for a
row of 32768 tokens holding 28 documents (mean 1024), one layer's attention forward and backward took 119.6 ms and
3.01 GiB of temporaries that way, against 32.9 ms and 0.25 GiB in the tile loop with tiles of 2048 rows (measured as
`context_attention` over a mesh of one device: the same loops). One custom_vjp holds both branches: its residuals are
q, k, v, the output and the softmax statistics ([B·M, Q, S] float32: the packed kernel's layout; a call in the tile
loop has its rows' logsumexp [rows, Q, S] first in its rows·M).

The packed layout is JAX's (internal) cuDNN wrapper's: `jax._src.cudnn.fused_attention_stablehlo`, Hopper or later;
JAX before 0.11.1 strides grouped-query K/V by the query's heads there, so it is used only from 0.11.1 (or without
grouped queries).

Shape letters: see `relaymoe_jax`; M a row's documents.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from models.attention import cudnn as cudnn_attention
from models.attention.context_parallel import (KERNEL_OUTPUTS, MIN_TILE, tile_loop_backward, tile_loop_forward,
                                               tile_rows)
from models.attention.cudnn import CUDNN_TILES, jax_cudnn
from models.attention.documents import packed_layout
from relaymoe_jax.axes import TENSOR

DOCUMENTS_PER_ROW = 16  # M: a call launches its rows·M sequences' tiles (empty ones exit at once)
CALL_TEMPORARY_BYTES = 2 << 30  # the most float32 temporaries one packed backward call may take
# Tile rows of the tile loop that a call over the bound takes: near a document's length, so a query tile skips most
# other documents' key tiles (32768 tokens, 28 documents: 32.9 ms with 2048 rows, 114.8 with 16384).
LONG_ROW_TILE = 2048


def packed_bound(most_documents, seq_len, query_heads, head_dim, budget=CALL_TEMPORARY_BYTES):
  """M for rows of `seq_len` tokens holding at most `most_documents` documents (as the data has them): that many, at
  least 2, and no more than one row's packed backward can hold within `budget` (its two float32 [S, Q, Z]
  temporaries a slot: see `rows_per_call`); a call with a row over it takes the tile loop, exact either way."""
  most_in_budget = budget // (2 * seq_len * query_heads * head_dim * 4)
  return max(2, min(most_documents, most_in_budget))


def rows_per_call(q_BSQZ, m=DOCUMENTS_PER_ROW, budget=CALL_TEMPORARY_BYTES):
  """The most of q's rows (a divisor of B, at least 1) one packed call may hold: cuDNN's backward takes two float32
  [S, Q, Z] temporaries for each of a call's rows·M slots (measured on an H200, 32 heads of 128, M = 16: 32.3 GiB
  for 16 rows of 4096 in one call, 2.3 a row at a time)."""
  b, s, heads, z = q_BSQZ.shape
  fit = max(1, budget // (2 * m * s * heads * z * 4))
  return max(d for d in range(1, min(b, fit) + 1) if b % d == 0)


def heads_split(kv_heads, tensor):
  """Whether the heads are split over 'tensor' (of size `tensor`) in the packed calls: where the K/V heads divide."""
  return kv_heads % tensor == 0


def documents_attention_on(q_BSQZ, k_BSJZ, v_BSJZ, segment_ids_BS, scale, mesh, batch_axes, m=DOCUMENTS_PER_ROW):
  """`documents_attention` on each device's rows of `mesh` (B split over `batch_axes`, the heads over 'tensor' where
  they divide over it; None: on one device), each device's packed calls holding `rows_per_call` of its rows."""
  def local(q_BSQZ, k_BSJZ, v_BSJZ, segment_ids_BS):
    return documents_attention(q_BSQZ, k_BSJZ, v_BSJZ, segment_ids_BS, scale, m, rows_per_call(q_BSQZ, m))

  if mesh is None:
    return local(q_BSQZ, k_BSJZ, v_BSJZ, segment_ids_BS)
  heads = TENSOR if TENSOR in mesh.shape and heads_split(k_BSJZ.shape[2], mesh.shape[TENSOR]) else None
  spec, segments_spec = P(batch_axes, None, heads, None), P(batch_axes, None)
  return jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec, segments_spec), out_specs=spec,
                       check_vma=False)(q_BSQZ, k_BSJZ, v_BSJZ, segment_ids_BS)


def unavailable(platform, q_BSQZ, k_BSJZ):
  """Why the packed layout cannot attend these on `platform`'s devices, or None."""
  reason = cudnn_attention.unavailable(platform, q_BSQZ.dtype, q_BSQZ.shape[-1])
  if reason is None and not jax_cudnn.check_compute_capability("9.0"):
    reason = "cuDNN's packed layout needs a Hopper or later GPU"
  if reason is None and q_BSQZ.shape[2] != k_BSJZ.shape[2] and jax.__version_info__ < (0, 11, 1):
    reason = f"JAX {jax.__version__} misplaces grouped-query K/V in cuDNN's packed layout (fixed in 0.11.1)"
  return reason


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def documents_attention(q_BSQZ, k_BSJZ, v_BSJZ, segment_ids_BS, scale, m=DOCUMENTS_PER_ROW, rows=None):
  """Causal attention within each document of `segment_ids_BS` (int [B, S], non-decreasing along each row);
  `rows`: rows per packed cuDNN call, the calls one after another (None: all at once)."""
  return _forward(q_BSQZ, k_BSJZ, v_BSJZ, segment_ids_BS, scale, m, rows)[0]


def long_row_tile(s):
  """Tile rows of the tile loop over a row of `s` tokens: a divisor of s, at most half the row (so a row's second
  half can skip its first's key tiles) and LONG_ROW_TILE; the whole row where that divisor would be tiny."""
  tile = tile_rows(s, min(LONG_ROW_TILE, max(1, s // 2)))
  return tile if tile >= min(MIN_TILE, s // 2) else s


def _forward(q_BSQZ, k_BSJZ, v_BSJZ, segment_ids_BS, scale, m, rows):
  if m < 2:  # JAX's wrapper takes a bound of one for no packing at all
    raise ValueError(f"documents_attention: m={m} documents a row; the packed layout needs at least 2")

  def call(q_BSQZ, k_BSJZ, v_BSJZ, segment_ids_BS):
    lengths_BM, offsets_BM1, fits = packed_layout(segment_ids_BS, m)

    def packed(q_BSQZ, k_BSJZ, v_BSJZ):
      return jax_cudnn.dot_product_attention(
          q_BSQZ, k_BSJZ, v_BSJZ, q_seqlen=lengths_BM, kv_seqlen=lengths_BM, q_offsets=offsets_BM1,
          kv_offsets=offsets_BM1, scale=scale, mask_type=jax_cudnn.MaskType.PADDING_CAUSAL, qkv_layout="BTNH",
          return_residual=True)

    def tiled(q_BSQZ, k_BSJZ, v_BSJZ):
      o_BSQZ, lse_BQS = tile_loop_forward(q_BSQZ, k_BSJZ, v_BSJZ, segment_ids_BS, scale, long_row_tile(q_BSQZ.shape[1]),
                                          CUDNN_TILES)
      return o_BSQZ, jnp.pad(lse_BQS, ((0, lse_BQS.shape[0] * (m - 1)), (0, 0), (0, 0)))

    return jax.lax.cond(fits, packed, tiled, q_BSQZ, k_BSJZ, v_BSJZ)

  o_BSQZ, stats = checkpoint_name(_in_groups(call, rows, q_BSQZ, k_BSJZ, v_BSJZ, segment_ids_BS), KERNEL_OUTPUTS)
  return o_BSQZ, (q_BSQZ, k_BSJZ, v_BSJZ, segment_ids_BS, o_BSQZ, stats)


def _backward(scale, m, rows, residuals, do_BSQZ):
  def call(q_BSQZ, k_BSJZ, v_BSJZ, segment_ids_BS, o_BSQZ, stats, do_BSQZ):
    lengths_BM, offsets_BM1, fits = packed_layout(segment_ids_BS, m)

    def packed(do_BSQZ):
      unused = jnp.zeros(0, q_BSQZ.dtype)  # no bias, no page tables
      grads = jax_cudnn._dot_product_attention_bwd_p_wrapper.bind(
          q_BSQZ, k_BSJZ, v_BSJZ, unused, lengths_BM, lengths_BM, offsets_BM1, offsets_BM1, unused, unused, stats,
          o_BSQZ, do_BSQZ.astype(q_BSQZ.dtype), scale=scale, seed=0, dropout_rate=0.0, variadic_args=(False, False),
          mask_type=jax_cudnn.MaskType.PADDING_CAUSAL, layout=jax_cudnn.AttentionLayout.BTNH.value,
          sliding_window_length=None)
      return tuple(grads[:3])

    def tiled(do_BSQZ):
      return tile_loop_backward(q_BSQZ, k_BSJZ, v_BSJZ, segment_ids_BS, o_BSQZ, stats[:q_BSQZ.shape[0]], do_BSQZ,
                                scale, long_row_tile(q_BSQZ.shape[1]), CUDNN_TILES)

    return jax.lax.cond(fits, packed, tiled, do_BSQZ)

  return (*_in_groups(call, rows, *residuals, do_BSQZ), None)


def _in_groups(f, rows, *arrays):
  """f over groups of `rows` of the B rows (each array's leading axis: B, or B·M for the statistics), one group after
  another, its outputs' groups joined again: the packed kernels' workspaces scale with the rows of one call, and a
  row of too many documents sends only its own call to the tile loop."""
  b = arrays[0].shape[0]
  groups = b // math.gcd(b, rows or b)
  if groups == 1:
    return f(*arrays)
  out = jax.lax.map(lambda xs: f(*xs), [a.reshape(groups, -1, *a.shape[1:]) for a in arrays])
  return jax.tree.map(lambda o: o.reshape(-1, *o.shape[2:]), out)


documents_attention.defvjp(_forward, _backward)
