"""A hop's chunk ladder and the walk over it: the sizes a hop's pairs are computed in (`chunk_ladder`,
`default_chunk_rows`) and `for_each_chunk`, which walks a range of expert-sorted pairs in chunks of those sizes.

No communication. The chunk count is data-dependent (`while_loop`s), so any routing skew is computed with no drops
and no padding. Shape letters: see relaymoe_jax.
"""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from relaymoe_jax.errors import UserError
from relaymoe_jax.kernels.grouped_matmul import ROW_ALIGN
from relaymoe_jax.pair_plan import chunk_group_sizes

# A hop's chunks: the first size takes the bulk, then sizes 4× smaller, down to no less than LADDER_MIN_ROWS, take
# its tail. Below LADDER_MIN_ROWS · LADDER_STEP rows there is one size (less to compile, and little to waste).
LADDER_STEP = 4
LADDER_LEVELS = 3
LADDER_MIN_ROWS = 1024


def _round_up(rows, multiple=ROW_ALIGN):
  return multiple * math.ceil(rows / multiple)


def chunk_ladder(rows):
  """(rows, rows/4, rows/16, …) rounded up to 128, LADDER_LEVELS at most, none below LADDER_MIN_ROWS."""
  ladder = [rows]
  while len(ladder) < LADDER_LEVELS and ladder[-1] >= LADDER_MIN_ROWS * LADDER_STEP:
    ladder.append(_round_up(ladder[-1] // LADDER_STEP))
  return tuple(ladder)


def default_chunk_rows(tokens_per_device, top_k, ring_size, row_cap=None):
  """The ladder for a hop whose balanced share is ceil(T·K / N) rows.

  With a ladder, the first size is 31/32 of the share, so that a hop near balance runs one full chunk and one
  small one; a first size of the whole share would run a second full-size chunk for a single extra row. A ring of
  one has one hop holding every pair, never more than the share: one chunk of it.
  """
  share = _round_up(math.ceil(tokens_per_device * top_k / ring_size))
  if ring_size == 1 and not (row_cap and row_cap < share):
    return (share,)
  if row_cap:
    share = min(share, row_cap)
  if len(chunk_ladder(share)) > 1:
    share = _round_up(share - share // 32)
  return chunk_ladder(share)


def check_ladder(chunk_rows):
  """A dispatcher's `chunk_rows` (an int, laddered by `chunk_ladder`, or a descending tuple) as a ladder."""
  ladder = tuple(chunk_rows) if isinstance(chunk_rows, (tuple, list)) else (chunk_rows,)
  if (not ladder or any(not isinstance(r, int) or isinstance(r, bool) or r < 1 for r in ladder)
      or list(ladder) != sorted(ladder)[::-1]):
    raise UserError(f"chunk_rows={chunk_rows!r} must be a positive int or a descending tuple of positive ints")
  return chunk_ladder(ladder[0]) if isinstance(chunk_rows, int) else ladder


def check_row_cap(chunk_rows, row_cap):
  """A dispatcher's `max_chunk_rows` (`row_cap`): at least ROW_ALIGN, and not given with `chunk_rows`."""
  if row_cap is None:
    return
  if not isinstance(row_cap, int) or isinstance(row_cap, bool) or row_cap < ROW_ALIGN:
    raise UserError(f"max_chunk_rows={row_cap!r} must be an int of at least {ROW_ALIGN}")
  if chunk_rows is not None:
    raise UserError(f"chunk_rows={chunk_rows!r} and max_chunk_rows={row_cap!r}: give one (chunk_rows fixes the "
                    "sizes, max_chunk_rows caps the default ones)")


class ChunkRows(NamedTuple):
  """The rows of one chunk of a pair range."""

  first: jax.Array  # sorted-pair position of the chunk's first row
  count: jax.Array  # rows before the range's end
  pos_R: jax.Array  # sorted-pair positions, clipped into the pair list
  valid_R: jax.Array  # False past the range's end
  sizes_L: jax.Array  # group sizes of the valid rows


def chunk_at(pairs, offset, rows, num_pairs):
  """The chunk of `rows` rows at `offset` into the pair range `pairs` (a `pair_plan.PairRange`)."""
  iota_R = jnp.arange(rows, dtype=jnp.int32)
  count = jnp.clip(pairs.count - offset, 0, rows)
  return ChunkRows(first=pairs.start + offset, count=count,
                   pos_R=jnp.minimum(pairs.start + offset + iota_R, num_pairs - 1), valid_R=iota_R < count,
                   sizes_L=chunk_group_sizes(pairs.sizes_L, offset, rows))


def level_runs(chunk_rows, level, offset, count):
  """Whether a chunk of the ladder's `level` runs next at `offset`: full chunks of a size while at least that many
  pairs remain, the last size until the range is done."""
  if level == len(chunk_rows) - 1:
    return offset < count
  return count - offset >= chunk_rows[level]


def _while_level_runs(chunk_rows, level, count):
  def more(state):
    return level_runs(chunk_rows, level, state[0], count)

  return more


def for_each_chunk(pairs, chunk_rows, num_pairs, body, carry, static_chunks=None, offset=0):
  """carry = body(rows, carry) over the range `pairs` from `offset`, in chunks whose sizes come from the ladder
  `chunk_rows` (`rows`: a `ChunkRows`).

  `chunk_rows` is a descending tuple of row counts: full chunks of the first size while at least that many pairs
  remain, then of the next, and the last size until the range is done. A grouped kernel costs its static row count
  whatever the range's count, so the ladder bounds the tail's waste by the last size while most rows still go
  through the first. A while loop cannot be reverse-differentiated; `static_chunks` runs a fixed count of the first
  size instead (autodiff ablation).
  """

  def step(rows, offset, carry):
    return offset + rows, body(chunk_at(pairs, offset, rows, num_pairs), carry)

  if static_chunks is not None:
    return jax.lax.fori_loop(0, static_chunks, lambda c, carry: step(chunk_rows[0], c * chunk_rows[0], carry)[1],
                             carry)
  offset = jnp.int32(offset)
  for level, rows in enumerate(chunk_rows):
    offset, carry = jax.lax.while_loop(_while_level_runs(chunk_rows, level, pairs.count),
                                       lambda s, rows=rows: step(rows, *s), (offset, carry))
  return carry
