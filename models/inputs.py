"""A model's token inputs, checked where the model takes them: shapes and dtypes (a wrong shape failed deep in
RoPE, naming neither), ids in the vocabulary (eagerly where their values are known; traced, an id outside it embeds
as NaN, where indexing clamped it to a finite row), and segment ids as document numbers (a change of id starts a
document: `[0, 1, 0]` had the third span attend to the first)."""

import math

import jax.numpy as jnp

from models.attention.documents import document_starts, segment_positions
from relaymoe_jax.errors import UserError, check_ids_in_range


def checked_inputs(tokens_BS, segment_ids_BS, positions_BS, vocab_size):
  """(`segment_ids_BS` numbered 0, 1, ... along each row, `positions_BS` or each token's place in its document;
  None where not given), once the arguments are checked: integer arrays, `tokens_BS` [B, S] and the others its
  shape, ids in [0, `vocab_size`) where known."""
  if getattr(tokens_BS, "ndim", None) != 2:
    raise UserError(f"tokens_BS has shape {getattr(tokens_BS, 'shape', None)}; the model takes [batch, sequence]")
  for name, x in (("tokens_BS", tokens_BS), ("segment_ids_BS", segment_ids_BS), ("positions_BS", positions_BS)):
    if x is not None and not jnp.issubdtype(x.dtype, jnp.integer):
      raise UserError(f"{name} is {x.dtype}; it must be integers")
    if x is not None and x.shape != tokens_BS.shape:
      raise UserError(f"{name} has shape {tuple(x.shape)} and tokens_BS {tuple(tokens_BS.shape)}: one per token")
  check_ids_in_range(tokens_BS, vocab_size, "tokens_BS", "a token id")  # traced: `embed` gives NaN
  if segment_ids_BS is None:
    return None, positions_BS
  segment_ids_BS = jnp.cumsum(document_starts(segment_ids_BS), axis=1, dtype=jnp.int32) - 1
  return segment_ids_BS, segment_positions(segment_ids_BS) if positions_BS is None else positions_BS


def check_rows(rows, mesh, axes):
  """The batch's rows split evenly over the mesh `axes` that split a batch (JAX's own error named neither)."""
  shards = math.prod(mesh.shape[a] for a in axes)
  if rows % shards:
    over = " × ".join(f"{a}={mesh.shape[a]}" for a in axes)
    raise UserError(f"tokens_BS has {rows} rows, which do not split over the mesh's {shards} shards of rows ({over}): "
                    f"give a multiple of {shards}")


def embed(table_VD, tokens_BS):
  """Rows of `table_VD` for `tokens_BS`; NaN for an id outside the table (the trainer counts such ids and stops)."""
  inside_BS = (tokens_BS >= 0) & (tokens_BS < table_VD.shape[0])
  # Added, not selected: the gradient of a select is another select against a [B, S, D] buffer of zeros, which XLA
  # made with the loss head's and kept from the forward pass to the embedding's gradient at the step's end.
  return table_VD[tokens_BS] + jnp.where(inside_BS, 0, jnp.nan).astype(table_VD.dtype)[..., None]
