"""Spans of the sequence: a layer's per-position work on long rows as a scan over spans of positions, each step
rematerialised, so its temporaries are a span's, not the row's (`runtime.sequence_span_tokens`). Rows are cut along
the context-parallel chunks they are held in (each device's own positions, no data moves), then each chunk into
spans; one span a chunk is no scan at all.

Shape letters: see `relaymoe_jax` (its Qwen3.5 spans line).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from models import span_scan
from models.attention.context_parallel import splits_sequences
from relaymoe_jax.axes import EXPERT


# A span's positions are a multiple of this: the layers' matmuls over a span have them as rows, and XLA's GPU tiling
# failed to compile some other counts (compile-only for 8 H200s, the 40-layer Qwen3.5 step under context parallelism
# at 4,505,600 tokens, spans of 15645: `INTERNAL: Couldn't find output tile sizes`).
SPAN_GRANULE = 128


@dataclasses.dataclass(frozen=True)
class Spans:
  """Rows of positions cut into N `chunks` each (the context-parallel chunks in held order, else 1: the row) of
  `chunk` positions, each chunk into `count` spans of `length`, the last one padded."""
  chunks: int
  chunk: int
  count: int
  length: int

  @classmethod
  def of(cls, seq_len, chunks, span_tokens):
    """Rows of `seq_len` in spans of about `span_tokens` (0: whole chunks), as even as a multiple of SPAN_GRANULE
    (or of `span_tokens`, where that is less) lets them be."""
    chunk = seq_len // chunks
    if not span_tokens or chunk <= span_tokens:
      return cls(chunks, chunk, 1, chunk)
    granule = min(SPAN_GRANULE, span_tokens)
    even = -(-chunk // -(-chunk // span_tokens))  # the chunk over as few spans as `span_tokens` allows, evenly
    length = -(-even // granule) * granule
    return cls(chunks, chunk, -(-chunk // length), length)

  @classmethod
  def of_run(cls, seq_len, runtime, mesh):
    """The spans `runtime` cuts rows of `seq_len` into on `mesh` (per context-parallel chunk where it splits them)."""
    chunks = 2 * mesh.shape[EXPERT] if splits_sequences(runtime, mesh) else 1
    return cls.of(seq_len, chunks, runtime.sequence_span_tokens)

  def split(self, x_BS):
    """[B, S, ...] → [P, B, N, T, ...]; padding repeats a chunk's last segment id, else zeros."""
    x_BNC = x_BS.reshape(x_BS.shape[0], self.chunks, self.chunk, *x_BS.shape[2:])
    pad = self.count * self.length - self.chunk
    if pad:
      mode = "edge" if jnp.issubdtype(x_BNC.dtype, jnp.integer) else "constant"
      x_BNC = jnp.pad(x_BNC, [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * (x_BNC.ndim - 3), mode=mode)
    return jnp.moveaxis(x_BNC.reshape(*x_BNC.shape[:2], self.count, self.length, *x_BNC.shape[3:]), 2, 0)

  def join(self, x_PBNT):
    """The inverse of `split`: [P, B, N, T, ...] → [B, S, ...]."""
    x_BNPT = jnp.moveaxis(x_PBNT, 0, 2)
    x_BNC = x_BNPT.reshape(*x_BNPT.shape[:2], -1, *x_BNPT.shape[4:])[:, :, :self.chunk]
    return x_BNC.reshape(x_BNC.shape[0], -1, *x_BNC.shape[3:])

  def positions(self):
    """[P, 1, 1, T] float32: 1 at a chunk's positions, 0 at the padding."""
    kept = np.arange(self.count * self.length) < self.chunk
    return jnp.asarray(kept, jnp.float32).reshape(self.count, 1, 1, self.length)

  def whole(self, w, mesh):
    """A weight used in every span whole on every device (gathered once, not once a span, where it is split)."""
    return w if self.count == 1 else jax.lax.with_sharding_constraint(w, NamedSharding(mesh, P()))

  def map(self, f, *xs_BS):
    """`f` over the spans of [B, S, ...] inputs, a span at a time (each rematerialised): its [B, S, ...] output."""
    return self.join(self.scan(lambda _, xs: (None, f(*xs)), None, tuple(self.split(x) for x in xs_BS))[1])

  def scan(self, body, carry, xs):
    """`lax.scan(body, carry, xs)` over the spans, each step rematerialised (`models.span_scan`); one span: one plain
    call."""
    if self.count == 1:
      carry, ys = body(carry, jax.tree.map(lambda x: x[0], xs))
      return carry, jax.tree.map(lambda y: y[None], ys)
    return span_scan.scan(body, carry, xs)
