"""Causal attention of one whole sequence per row, optionally of packed documents that never see each other.

Documents are given by segment ids [B, S] (int, non-decreasing along each row: documents packed one after another);
a query sees a key only in its own segment. On XLA's implementation that is a boolean mask beside the causal one.
cuDNN flash attention (JAX's public `jax.nn.dot_product_attention`) takes no segment ids: it takes a boolean mask,
which JAX turns into an additive bias [B, 1, S, S] in the compute dtype that the kernel reads for every score, so
every tile is still computed (masked, not skipped). Reading it doubles the kernels' time (one H200, 16 × 4096, the
30B shape's heads: forward and backward 15.9 ms unmasked, 33.1 masked; `benchmarks.cp_attention --mean-doc`); a
backward without the bias's gradient, which JAX's wrapper always has cuDNN compute, measured no faster (33.0 ms).
Its packed layout (ragged offsets per document, which skips what a document cannot see) needs a static bound on
the documents per row and is not used yet.

Shape letters: see `relaymoe_jax`.
"""

import functools
import logging

import jax
import jax.numpy as jnp


def attention(q_BSQZ, k_BSJZ, v_BSJZ, scale, implementation, platform, segment_ids_BS=None):
  """Causal GQA attention through `jax.nn.dot_product_attention` (whose own default is XLA's implementation);
  `platform`: that of the devices it runs on, for "auto"; `segment_ids_BS`: a query sees only keys of its own
  segment (None: the whole row)."""
  mask = None if segment_ids_BS is None else same_segment(segment_ids_BS, segment_ids_BS)[:, None]
  attend = functools.partial(jax.nn.dot_product_attention, q_BSQZ, k_BSJZ, v_BSJZ, mask=mask, scale=scale,
                             is_causal=True)
  if implementation == "auto":
    if platform != "gpu" or q_BSQZ.dtype not in (jnp.bfloat16, jnp.float16):
      return attend(implementation="xla")
    try:
      return attend(implementation="cudnn")
    except Exception as err:  # noqa: BLE001  (cuDNN takes a subset of shapes and versions; it says so at trace time)
      _log_attention_fallback(f"{type(err).__name__}: {err}"[:200])
      return attend(implementation="xla")
  return attend(implementation=implementation)


def same_segment(query_segments_BA, key_segments_BW):
  """[B, A, W]: whether each query's segment is each key's."""
  return query_segments_BA[:, :, None] == key_segments_BW[:, None, :]


def segment_positions(segment_ids_BS):
  """Each token's place in its own segment (RoPE's positions for packed documents): 0 at each segment's start."""
  s = segment_ids_BS.shape[1]
  index_BS = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), segment_ids_BS.shape)
  starts_BS = jnp.concatenate([jnp.ones_like(segment_ids_BS[:, :1], bool),
                               segment_ids_BS[:, 1:] != segment_ids_BS[:, :-1]], axis=1)
  return index_BS - jax.lax.cummax(jnp.where(starts_BS, index_BS, 0), axis=1)


@functools.lru_cache(maxsize=None)
def _log_attention_fallback(reason):
  logging.getLogger(__name__).warning("cuDNN attention unavailable, using XLA's: %s", reason)
