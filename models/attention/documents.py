"""Packed documents given by segment ids [B, S] (int, non-decreasing along each row: documents one after another):
which keys a query may see, each token's place in its document, and cuDNN's packed layout of a row's documents.

Shape letters: see `relaymoe_jax`; M a row's documents.
"""

import jax
import jax.numpy as jnp


def same_document(segment_ids_BS):
  """[B, S, S]: whether each query's document is each key's."""
  return segment_ids_BS[:, :, None] == segment_ids_BS[:, None, :]


def document_starts(segment_ids_BS):
  """[B, S]: whether each token starts a document."""
  return jnp.concatenate([jnp.ones_like(segment_ids_BS[:, :1], bool),
                          segment_ids_BS[:, 1:] != segment_ids_BS[:, :-1]], axis=1)


def segment_positions(segment_ids_BS):
  """Each token's place in its own segment (RoPE's positions for packed documents): 0 at each segment's start."""
  index_BS = jnp.broadcast_to(jnp.arange(segment_ids_BS.shape[1], dtype=jnp.int32), segment_ids_BS.shape)
  return index_BS - jax.lax.cummax(jnp.where(document_starts(segment_ids_BS), index_BS, 0), axis=1)


def packed_layout(segment_ids_BS, m):
  """cuDNN's packed layout of each row's documents: (lengths [B, M], start offsets [B, M+1], both -1 past a row's
  documents; whether every row has at most `m` documents, else the layout is not theirs)."""
  b, s = segment_ids_BS.shape
  starts_BS = document_starts(segment_ids_BS)
  rank_BS = jnp.cumsum(starts_BS, axis=1, dtype=jnp.int32) - 1
  slot_BS = jnp.where(starts_BS, rank_BS, m)  # m: out of range, dropped
  index_BS = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
  starts_BM = jnp.full((b, m), -1, jnp.int32).at[jnp.arange(b)[:, None], slot_BS].set(index_BS, mode="drop")
  next_BM = jnp.concatenate([starts_BM[:, 1:], jnp.full((b, 1), -1, jnp.int32)], axis=1)
  lengths_BM = jnp.where(starts_BM >= 0, jnp.where(next_BM >= 0, next_BM, s) - starts_BM, -1)
  offsets_BM1 = jnp.concatenate([starts_BM, jnp.full((b, 1), -1, jnp.int32)], axis=1)
  return lengths_BM, offsets_BM1, jnp.all(rank_BS[:, -1] < m)
