"""Causal attention of one whole sequence per row, optionally of packed documents that never see each other.

Documents are given by segment ids [B, S] (`models.attention.documents`); a query sees a key only in its own segment. On XLA's
implementation that is a boolean mask beside the causal one. On cuDNN each document is attended as a sequence of
its own (`models.attention.cudnn_documents`: cuDNN's packed layout, on Hopper GPUs); elsewhere the mask goes to
`jax.nn.dot_product_attention`, which passes it to cuDNN as an additive bias [B, 1, S, S]: every causal tile is
computed, by a kernel twice as slow.

Shape letters: see `relaymoe_jax`.
"""

import functools
import logging

import jax
import jax.numpy as jnp

from models.attention import cudnn_documents
from models.attention.documents import same_document


def attention(q_BSQZ, k_BSJZ, v_BSJZ, scale, implementation, platform, segment_ids_BS=None, mesh=None,
              batch_axes=(), documents_per_row=cudnn_documents.DOCUMENTS_PER_ROW):
  """Causal GQA attention through `jax.nn.dot_product_attention` (whose own default is XLA's implementation), or
  cuDNN's packed documents; `platform`: that of the devices it runs on, for "auto"; `segment_ids_BS`: a query sees
  only keys of its own segment (None: the whole row); `mesh`, `batch_axes`: where the rows are split, so that
  cuDNN's packed calls are sized by one device's rows (None: on one device); `documents_per_row`: the packed
  layout's bound M."""
  mask = None if segment_ids_BS is None else same_document(segment_ids_BS)[:, None]
  public = functools.partial(jax.nn.dot_product_attention, q_BSQZ, k_BSJZ, v_BSJZ, mask=mask, scale=scale,
                             is_causal=True)
  if implementation == "xla" or (implementation == "auto" and (
      platform != "gpu" or q_BSQZ.dtype not in (jnp.bfloat16, jnp.float16))):
    return public(implementation="xla")
  if segment_ids_BS is not None and cudnn_documents.unavailable(platform, q_BSQZ, k_BSJZ) is None:
    attend = functools.partial(cudnn_documents.documents_attention_on, q_BSQZ, k_BSJZ, v_BSJZ, segment_ids_BS, scale,
                               mesh, batch_axes, documents_per_row)
  else:
    attend = functools.partial(public, implementation="cudnn")
  if implementation == "cudnn":
    return attend()
  try:
    return attend()
  except Exception as err:  # noqa: BLE001  (cuDNN takes a subset of shapes and versions; it says so at trace time)
    _log_attention_fallback(f"{type(err).__name__}: {err}"[:200])
    return public(implementation="xla")


@functools.lru_cache(maxsize=None)
def _log_attention_fallback(reason):
  logging.getLogger(__name__).warning("cuDNN attention unavailable, using XLA's: %s", reason)
