"""What both ring dispatchers share around their schedules: the static facts of one call (`RingSpec`), the per-device
results of a backward (`backward_outputs`), and `ring_vjp`, which makes a dispatcher's per-device forward and
backward one differentiable global function.

The forward and the backward are each one `shard_map`; the rings' sends are in `ring`. The only communication here
is in `backward_outputs`: weight gradients summed over the data-parallel axes, and under expert tensor parallelism
dx and d(router weight) summed over the tensor axis. Shape letters: see relaymoe_jax.
"""

import dataclasses
import functools
import math

import jax

from relaymoe_jax.ring.chunks import check_ladder, check_row_cap, default_chunk_rows
from relaymoe_jax import activations, gate_up
from relaymoe_jax.kernels.grouped_matmul import max_chunk_rows, resolve_backend
from relaymoe_jax.layout import ExpertLayout
from relaymoe_jax.pair_plan import unsort_pair_values


@dataclasses.dataclass(frozen=True)
class RingSpec:
  """Static facts of one ring call (hashable: compiled functions are cached on it)."""

  layout: ExpertLayout
  num_experts: int
  top_k: int
  chunk_rows: tuple[int, ...]  # the chunk-size ladder of a hop (see `chunks.for_each_chunk`)
  backend: str
  activation: str = "swiglu"  # the experts' (see `activations`)
  static_chunks: int | None = None  # autodiff ablation: a fixed worst-case chunk count instead of a while loop

  @property
  def experts_per_device(self):
    return self.num_experts // self.layout.ring_size

  @property
  def chunk_options(self):
    return dict(chunk_rows=self.chunk_rows, backend=self.backend, activation=self.activation)


def _ladder(layout, backend, chunk_rows, row_cap, tokens_per_device, top_k, w_gate_EDF, activation):
  if chunk_rows is not None:
    return check_ladder(chunk_rows)
  _, d_model, d_ff = w_gate_EDF.shape
  num_experts = layout.num_experts(w_gate_EDF)
  # The widest grouped matmul of a hop is the input projection, gate and up fused for gated experts: U = 2F (per
  # tensor-parallel slice) columns.
  width = (2 if activations.is_gated(activation) else 1) * d_ff // layout.tensor_size
  caps = [c for c in (row_cap, max_chunk_rows(backend, num_experts // layout.ring_size, max(d_model, width))) if c]
  return default_chunk_rows(tokens_per_device, top_k, layout.ring_size, min(caps, default=None))


def make_ring_spec(layout, x_TD, idx_TK, w_gate_EDF, *, chunk_rows, backend, activation="swiglu", recompute=True,
                   row_cap=None):
  """`activation`: the experts' (`activations`). `row_cap` (a dispatcher's `max_chunk_rows`): the default ladder's
  largest chunk at most this many rows. `recompute=False` (the autodiff ablation): one chunk size and a fixed chunk
  count per hop."""
  check_row_cap(chunk_rows, row_cap)
  backend = resolve_backend(backend, layout.mesh)
  tokens_per_device = x_TD.shape[0] // layout.token_shards
  top_k = idx_TK.shape[1]
  ladder = _ladder(layout, backend, chunk_rows, row_cap, tokens_per_device, top_k, w_gate_EDF, activation)
  if not recompute:
    ladder = ladder[:1]
  static_chunks = None if recompute else math.ceil(tokens_per_device * top_k / ladder[0])
  return RingSpec(layout=layout, num_experts=layout.num_experts(w_gate_EDF), top_k=top_k, chunk_rows=ladder, backend=backend,
                  activation=activations.check(activation), static_chunks=static_chunks)


def backward_outputs(spec, plan, grads, dw_gate_up, dw_down, x_TD, w_TK):
  """A ring backward's per-device results: weight gradients split back into gate and up (a plain expert's input
  matrix and None for its absent up) and summed over the data axes; dx and d(router weight) summed over the tensor
  axis (ETP) and put back in token order; input dtypes."""
  layout = spec.layout
  dw_gate, dw_up = gate_up.input_weight_grads(dw_gate_up, activations.is_gated(spec.activation))
  dW = tuple(None if d is None else d.astype(x_TD.dtype) for d in (dw_gate, dw_up, dw_down))
  if layout.replica_axes:
    dW = jax.lax.psum(dW, layout.replica_axes)
  dx_TD = layout.sum_tensor_partials(grads.dx_TD)
  dw_P = grads.pair_weight_grads(plan.order_P.shape[0])
  dw_TK = unsort_pair_values(plan, layout.sum_tensor_partials(dw_P), w_TK.shape)
  return (dx_TD.astype(x_TD.dtype), dw_TK.astype(w_TK.dtype), *dW)


@functools.lru_cache(maxsize=128)
def ring_vjp(spec, forward_device, backward_device, kept_specs=()):
  """The global function of a ring dispatcher (cached, one per spec and pair of per-device functions): a
  `jax.custom_vjp` whose forward and backward are each one `shard_map` of a per-device function.

  forward_device(x, idx, w_TK, w_gate, w_up, w_down, *, spec) -> (y, order_P, counts_E, *kept): the pair plan (and
  any per-device arrays `kept`, with specs `kept_specs`) are the only residuals besides the inputs.
  backward_device(x, w_TK, w_gate, w_up, w_down, order_P, counts_E, *kept, dy, *, spec) -> (dx, dw_TK, dw_gate,
  dw_up, dw_down).
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
