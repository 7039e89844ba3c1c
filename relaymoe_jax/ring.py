"""The two ring schedules both dispatchers are built from (inside `shard_map`, along one mesh axis of size N;
device r sends to r + 1 and receives from r − 1, so at hop h it holds the payload that started on r − h).

  ring_pass   the payload circulates; each hop computes on it into local state. N − 1 sends of the payload.
  ring_relay  the payload circulates, and each hop's partial result for the payload's partition is relayed: the
              partition's accumulator follows one hop behind its payload, merged into the same `ppermute`, and a
              last send brings it home. N − 1 payload sends, N accumulator sends; the accumulator of a hop is sent
              only after the hop's own partial is added, while the payload for the next hop is already in flight.
`ring_vjp` wraps a dispatcher's per-device forward and backward into one differentiable global function.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from relaymoe_jax.grouped_matmul import ROW_ALIGN, max_chunk_rows, resolve_backend, split_gate_up
from relaymoe_jax.layout import ExpertLayout
from relaymoe_jax.pair_plan import unsort_pair_values


def ring_perm(n, shift=1):
  """ppermute pairs sending device r to r + shift (mod n)."""
  return [(r, (r + shift) % n) for r in range(n)]


def partition_at_hop(r, h, n):
  """Whose payload device r holds at hop h: payloads move r → r+1, so the one that started on r − h."""
  return (r - h) % n


def ring_pass(compute, state, payload, *, axis, n):
  """state = compute(state, partition, payload) for hops h = 0 … N−1 (partition (r − h) mod N), the payload sent
  on before each hop's compute. Returns (state, the payload of the last hop: device r + 1's)."""
  r = jax.lax.axis_index(axis)

  def body(h, carry):
    payload, state = carry
    incoming = jax.lax.ppermute(payload, axis, ring_perm(n))  # prefetch for hop h + 1
    return incoming, compute(state, partition_at_hop(r, h, n), payload)

  payload, state = jax.lax.fori_loop(0, n - 1, body, (payload, state))
  return compute(state, partition_at_hop(r, n - 1, n), payload), payload


def ring_relay(compute, state, payload, *, axis, n, to_relay, home=None):
  """Runs (state, partial) = compute(state, partition, payload) at every hop and relays the partials.

  Args:
    compute: returns the new local state and this hop's partial for the payload's partition (float32 or the
      accumulator's travelling dtype; merged with the arriving accumulator in float32).
    to_relay: casts a float32 partial to the accumulator's travelling form (e.g. the weights' dtype).
    home: None: `payload` is this device's own and travels r → r + 1 (partition (r − h) mod N at hop h); the last
      hop's accumulator is sent home: N − 1 payload sends, N accumulator sends. Else `payload` is device r + 1's
      (what `ring_pass` holds after its last hop) and travels r → r − 1 (partition (r + 1 + h) mod N), so the last
      hop is on `home` (this device's own payload, already here) and its accumulator is merged in place:
      N − 2 payload sends, N − 1 accumulator sends, and none after the last hop.

  Returns:
    (state, accumulator of this device's own partition, summed over all N devices).
  """
  r = jax.lax.axis_index(axis)
  if home is None:
    perm, partition = ring_perm(n), lambda h: partition_at_hop(r, h, n)
  else:
    perm, partition = ring_perm(n, -1), lambda h: (r + 1 + h) % n

  def merge(acc_in, partial):
    return to_relay(jax.tree.map(lambda a, p: a.astype(jnp.float32) + p, acc_in, partial))

  def body(h, carry):
    payload, acc_prev, state = carry
    incoming, acc_in = jax.lax.ppermute((payload, acc_prev), axis, perm)
    state, partial = compute(state, partition(h), payload)
    return incoming, merge(acc_in, partial), state

  if n == 1:
    state, partial = compute(state, partition(0), payload)
    return state, to_relay(partial)
  # Payload sends: for hops 1 … N−1, or with `home` for hops 1 … N−2 (the last hop's payload is already here).
  last_sent = n - 1 if home is None else n - 2
  incoming = jax.lax.ppermute(payload, axis, perm) if last_sent >= 1 else home  # hop 0's prefetch
  state, partial = compute(state, partition(0), payload)
  # The payload must have arrived before the accumulator's send starts. Left free, XLA scheduled this prefetch
  # after hop 0's compute, next to that send, and hop 1 waited for it (2×H200 trace, docs/overlap.md).
  incoming, partial = jax.lax.optimization_barrier((incoming, partial))
  carry = (incoming, to_relay(partial), state)
  if last_sent > 1:  # (not traced when empty: each trace of `compute` is compiled again, grouped kernels and all)
    carry = jax.lax.fori_loop(1, last_sent, body, carry)
  payload, acc, state = carry
  if home is not None and n > 2:  # hop N−2: only the accumulator moves; the next payload is `home`
    acc_in = jax.lax.ppermute(acc, axis, perm)
    state, partial = compute(state, partition(n - 2), payload)
    payload, acc = home, merge(acc_in, partial)
  acc_in = jax.lax.ppermute(acc, axis, perm)  # hop N−1: accumulator only
  state, partial = compute(state, partition(n - 1), payload)
  if home is not None:
    return state, merge(acc_in, partial)
  return state, jax.lax.ppermute(merge(acc_in, partial), axis, perm)  # home


@dataclasses.dataclass(frozen=True)
class RingSpec:
  """Static facts of one ring call (hashable: compiled functions are cached on it)."""

  layout: ExpertLayout
  num_experts: int
  top_k: int
  chunk_rows: tuple[int, ...]  # the chunk-size ladder of a hop (see `hop.for_each_chunk`)
  backend: str
  static_chunks: int | None = None  # autodiff ablation: a fixed worst-case chunk count instead of a while loop
  reverse_backward: bool = False  # ring_expert: the backward starts from the forward's last payload (`ring_relay`)
  keep_gate_up: bool = False  # ring_expert: the forward keeps x·[gate | up] of every pair for the backward

  @property
  def experts_per_device(self):
    return self.num_experts // self.layout.ring_size

  @property
  def chunk_options(self):
    return dict(chunk_rows=self.chunk_rows, backend=self.backend)


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


def _check_ladder(chunk_rows):
  ladder = (chunk_rows,) if isinstance(chunk_rows, int) else tuple(chunk_rows)
  if not ladder or any(not isinstance(r, int) or r < 1 for r in ladder) or list(ladder) != sorted(ladder)[::-1]:
    raise ValueError(f"chunk_rows={chunk_rows!r} must be a positive int or a descending tuple of positive ints")
  return chunk_ladder(ladder[0]) if isinstance(chunk_rows, int) else ladder


def _check_row_cap(chunk_rows, row_cap):
  if row_cap is None:
    return
  if not isinstance(row_cap, int) or isinstance(row_cap, bool) or row_cap < ROW_ALIGN:
    raise ValueError(f"max_chunk_rows={row_cap!r} must be an int of at least {ROW_ALIGN}")
  if chunk_rows is not None:
    raise ValueError(f"chunk_rows={chunk_rows!r} and max_chunk_rows={row_cap!r}: give one (chunk_rows fixes the "
                     "sizes, max_chunk_rows caps the default ones)")


def make_ring_spec(layout, x_TD, idx_TK, w_gate_EDF, *, chunk_rows, backend, recompute=True,
                   reverse_backward=False, row_cap=None, keep_gate_up=False):
  """`row_cap` (a dispatcher's `max_chunk_rows`): the default ladder's largest chunk at most this many rows."""
  _check_row_cap(chunk_rows, row_cap)
  if keep_gate_up and not recompute:
    raise ValueError("keep_gate_up=True needs recompute=True (without it, plain autodiff keeps every intermediate)")
  backend = resolve_backend(backend, layout.mesh)
  tokens_per_device = x_TD.shape[0] // layout.token_shards
  top_k = idx_TK.shape[1]
  num_experts, d_model, d_ff = w_gate_EDF.shape
  # The widest grouped matmul of a hop is gate and up fused: 2F (per tensor-parallel slice) columns.
  caps = [c for c in (row_cap, max_chunk_rows(backend, num_experts // layout.ring_size,
                                               max(d_model, 2 * d_ff // layout.tensor_size))) if c]
  ladder = (_check_ladder(chunk_rows) if chunk_rows is not None
            else default_chunk_rows(tokens_per_device, top_k, layout.ring_size, min(caps, default=None)))
  if not recompute:
    ladder = ladder[:1]
  static_chunks = None if recompute else math.ceil(tokens_per_device * top_k / ladder[0])
  return RingSpec(layout=layout, num_experts=num_experts, top_k=top_k, chunk_rows=ladder, backend=backend,
                  static_chunks=static_chunks, reverse_backward=reverse_backward, keep_gate_up=keep_gate_up)


def backward_outputs(layout, plan, grads, dw_gate_up, dw_down, x_TD, w_TK):
  """A ring backward's per-device results: weight gradients split back into gate and up and summed over the data
  axes; dx and d(router weight) summed over the tensor axis (ETP) and put back in token order; input dtypes."""
  dW = tuple(d.astype(x_TD.dtype) for d in (*split_gate_up(dw_gate_up), dw_down))
  if layout.replica_axes:
    dW = jax.lax.psum(dW, layout.replica_axes)
  dx_TD = layout.sum_tensor_partials(grads.dx_TD)
  dw_P = grads.pair_weight_grads(plan.order_P.shape[0])
  dw_TK = unsort_pair_values(plan, layout.sum_tensor_partials(dw_P), w_TK.shape)
  return (dx_TD.astype(x_TD.dtype), dw_TK.astype(w_TK.dtype), *dW)


@functools.lru_cache(maxsize=128)
def ring_vjp(spec, forward_device, backward_device, kept_specs=()):
  """The global function of a ring dispatcher (cached, one per spec): a `jax.custom_vjp` whose forward and
  backward are each one `shard_map` of a per-device function.

  forward_device(x, idx, w_TK, w_gate, w_up, w_down) -> (y, order_P, counts_E, *kept): the pair plan (and any
  per-device arrays `kept`, with specs `kept_specs`) are the only residuals besides the inputs.
  backward_device(x, w_TK, w_gate, w_up, w_down, order_P, counts_E, *kept, dy) -> (dx, dw_TK, dw_gate, dw_up,
  dw_down).
  """
  layout = spec.layout
  tok, experts = layout.token_spec, layout.expert_specs
  forward = layout.shard_map(functools.partial(forward_device, spec=spec), in_specs=(tok, tok, tok, *experts),
                             out_specs=(tok, tok, tok, *kept_specs))
  if spec.static_chunks is not None:
    return lambda *args: forward(*args)[0]
  backward = layout.shard_map(functools.partial(backward_device, spec=spec),
                              in_specs=(tok, tok, *experts, tok, tok, *kept_specs, tok),
                              out_specs=(tok, tok, *experts))

  @jax.custom_vjp
  def ring(x_TD, idx_TK, w_TK, w_gate, w_up, w_down):
    return forward(x_TD, idx_TK, w_TK, w_gate, w_up, w_down)[0]

  def ring_fwd(x_TD, idx_TK, w_TK, w_gate, w_up, w_down):
    y_TD, *plan_and_kept = forward(x_TD, idx_TK, w_TK, w_gate, w_up, w_down)
    return y_TD, (x_TD, w_TK, w_gate, w_up, w_down, *plan_and_kept)

  def ring_bwd(residuals, dy_TD):
    dx, dw_TK, dw_gate, dw_up, dw_down = backward(*residuals, layout.place(dy_TD, tok))
    return dx, None, dw_TK, dw_gate, dw_up, dw_down

  ring.defvjp(ring_fwd, ring_bwd)
  return ring
