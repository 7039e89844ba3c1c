"""Qwen3.5's Gated DeltaNet layer (`Qwen3_5MoeGatedDeltaNet`), in spans of the sequence when rows are long.

The layer: one projection to [q | k | v], a causal depthwise conv with SiLU, the gated delta rule
(`models.attention.gated_delta`) with β = sigmoid(b) and log decay g = −exp(A_log) · softplus(a + dt_bias), then an
RMSNorm gated by SiLU(z) and the output projection. Packed documents restart the conv window and the state.

Spans. Every part but the rule is per token save the conv, which reads the W − 1 positions before each one. A row
(under context parallelism each of its chunks, `models.attention.context_parallel`) longer than
`runtime.sequence_span_tokens` is cut into spans, and the layer runs as three passes: a scan over spans projecting
and convolving (the conv's last W − 1 inputs carried from span to span; a chunk's first span gets them from the
chunk before it in the sequence, `preceding_rows`), the rule over the whole row (spans of its own, the state
carried), and a scan over spans for the gate's projection, the norm and the output projection. Each scan's body is
rematerialised: backward recomputes one span at a time, so a [positions, 8192] activation exists once (q | k | v)
instead of a dozen times (forward and backward copies of the projection, conv, SiLU, split and their float32
gradients). One span (a short row) runs the passes as plain calls, with nothing recomputed.

Shape letters: see `relaymoe_jax`; in this layer R counts rows of chunks, T a span's positions, X a key head's
width, W the conv window, P spans.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from models.attention.context_parallel import splits_sequences
from models.attention.gated_delta import gated_delta_rule
from models.attention.gated_delta_context import context_gated_delta_rule, on_row_shards, preceding_rows
from models.qwen3 import model as qwen3
from models.sharding import batch_axes, make_param
from relaymoe_jax.axes import EXPERT


def gated_rms_norm(x, gate, weight, eps):
  """The DeltaNet's output norm: RMSNorm (scale `weight`, not zero-centred) times SiLU(gate) in float32."""
  x32 = x.astype(jnp.float32)
  y = (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)
  return (weight.astype(x.dtype) * y * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)


def causal_conv(x_BSC, w_CW, segment_ids_BS=None):
  """Depthwise causal conv over S (Hugging Face's conv1d with W − 1 zeros of left padding): out[t] = Σ_j w[:, j] ·
  x[t − (W − 1) + j], inputs from another document (`segment_ids_BS`) or before the row read as zeros."""
  width = w_CW.shape[1]
  out = jnp.zeros(x_BSC.shape, jnp.float32)
  for j in range(width):
    shift = width - 1 - j
    shifted = jnp.pad(x_BSC, [(0, 0), (shift, 0), (0, 0)])[:, :x_BSC.shape[1]]
    if segment_ids_BS is not None and shift:
      same = segment_ids_BS == jnp.pad(segment_ids_BS, [(0, 0), (shift, 0)], constant_values=-1)[:, :-shift]
      shifted = jnp.where(same[..., None], shifted, 0)
    out = out + shifted.astype(jnp.float32) * w_CW[:, j].astype(jnp.float32)
  return out.astype(x_BSC.dtype)


@dataclasses.dataclass(frozen=True)
class Spans:
  """Rows of S positions cut into `chunks` each (the context-parallel chunks in held order, else 1: the row), each
  chunk into `count` spans of `length` (the last padded)."""
  chunks: int
  count: int
  length: int

  @classmethod
  def of(cls, seq_len, chunks, span_tokens):
    chunk = seq_len // chunks
    count = 1 if not span_tokens or chunk <= span_tokens else -(-chunk // span_tokens)
    return cls(chunks, count, -(-chunk // count))

  def split(self, x_BS):
    """[B, S, ...] → [P, R, T, ...], R = B × chunks rows; padding repeats a chunk's last segment id, else zeros."""
    b, s = x_BS.shape[:2]
    x_RC = x_BS.reshape(b * self.chunks, s // self.chunks, *x_BS.shape[2:])
    pad = self.count * self.length - x_RC.shape[1]
    if pad:
      mode = "edge" if jnp.issubdtype(x_RC.dtype, jnp.integer) else "constant"
      x_RC = jnp.pad(x_RC, [(0, 0), (0, pad)] + [(0, 0)] * (x_RC.ndim - 2), mode=mode)
    return jnp.moveaxis(x_RC.reshape(x_RC.shape[0], self.count, self.length, *x_RC.shape[2:]), 1, 0)

  def join(self, x_PRT, seq_len):
    """The inverse of `split`: [P, R, T, ...] → [B, S, ...]."""
    x_RC = jnp.moveaxis(x_PRT, 0, 1).reshape(x_PRT.shape[1], self.count * self.length, *x_PRT.shape[3:])
    x_RC = x_RC[:, :seq_len // self.chunks]
    return x_RC.reshape(x_RC.shape[0] // self.chunks, seq_len, *x_RC.shape[2:])

  def scan(self, body, carry, xs):
    """`lax.scan(body, carry, xs)` over the spans, each step rematerialised; one span: one plain call."""
    if self.count == 1:
      carry, ys = body(carry, jax.tree.map(lambda x: x[0], xs))
      return carry, jax.tree.map(lambda y: y[None], ys)
    return lax.scan(jax.checkpoint(body), carry, xs)


# The kernel path on GPUs. Off until a GPU has run it: rewritten (the inverses as kernels, the output out of the
# sequential kernel) in a session that got no GPU, it is checked in Pallas' interpreter and lowered to Triton on CPU
# only; the kernels it replaced passed `pytest -m gpu` at 0.6 of the XLA form's time (git history). On once
# `pytest -m gpu` passes with it and `benchmarks.gated_deltanet` has measured it.
KERNELS_ON_GPU = False


def delta_state_kernel(runtime, platform):
  """The gated delta rule's loop over chunks: the Pallas kernels on GPUs (once `KERNELS_ON_GPU`; not with
  runtime.attention_implementation=xla), XLA's scan elsewhere."""
  on = KERNELS_ON_GPU and platform == "gpu" and runtime.attention_implementation != "xla"
  return "pallas" if on else "xla"


def delta_rule(runtime, mesh):
  """The gated delta rule as `runtime` runs it on `mesh`: split over sequences (context parallelism: state passing),
  or the Pallas kernels on each device's rows (XLA cannot partition them), or XLA's form on the whole batch."""
  kernel = delta_state_kernel(runtime, mesh.devices.flat[0].platform)
  rule = dict(state_kernel=kernel, span_tokens=runtime.sequence_span_tokens or None)
  if splits_sequences(runtime, mesh):
    return functools.partial(context_gated_delta_rule, mesh=mesh, **rule)
  if kernel == "xla":
    return functools.partial(gated_delta_rule, **rule)
  return functools.partial(on_row_shards, functools.partial(gated_delta_rule, **rule), mesh=mesh,
                           axes=batch_axes(runtime))


class GatedDeltaNet(qwen3.Layer):
  """Linear attention by the gated delta rule (`Qwen3_5MoeGatedDeltaNet`), documents restarting its state."""

  def __init__(self, config, runtime, mesh, rngs):
    super().__init__(config, runtime)
    self.mesh = mesh
    param = functools.partial(make_param, config, runtime, mesh, rngs)
    c = config
    d, heads = c.hidden_size, c.linear_num_value_heads
    keys, values = c.linear_num_key_heads * c.linear_key_head_dim, heads * c.linear_value_head_dim
    self.in_qkv_DC = param("delta_in_DC", (d, 2 * keys + values))
    self.in_z_DC = param("delta_in_DC", (d, values))
    self.in_b_DC, self.in_a_DC = param("delta_in_DC", (d, heads)), param("delta_in_DC", (d, heads))
    self.conv_CW = param("delta_conv_CW", (2 * keys + values, c.linear_conv_kernel_dim))
    self.a_log_Q = param("delta_head_Q", (heads,), "a_log")
    self.dt_bias_Q = param("delta_head_Q", (heads,), "ones")
    self.norm_X = param("head_norm", (c.linear_value_head_dim,), "ones")
    self.out_CD = param("delta_out_CD", (values, d))

  def __call__(self, x_BSD, positions_BS, segment_ids_BS=None):
    del positions_BS  # the recurrence knows the order
    c = self.config
    b, s, _ = x_BSD.shape
    hk, hv, dk, dv = (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
                      c.linear_value_head_dim)
    split = splits_sequences(self.runtime, self.mesh)
    spans = Spans.of(s, 2 * self.mesh.shape[EXPERT] if split else 1, self.runtime.sequence_span_tokens)
    seg_PRT = None if segment_ids_BS is None else spans.split(segment_ids_BS)
    x_PRTD = spans.split(x_BSD)
    w = self._weights(spans)
    history = self._history(x_BSD, segment_ids_BS, split, w)
    _, (qkv_PRTC, g_PRTQ, beta_PRTQ) = spans.scan(functools.partial(self._mix_inputs, w), history,
                                                  (x_PRTD, seg_PRT))
    q, k, v = jnp.split(spans.join(qkv_PRTC, s), [hk * dk, 2 * hk * dk], axis=-1)
    with jax.named_scope("deltanet"):
      o_BSQX, _ = delta_rule(self.runtime, self.mesh)(
          q.reshape(b, s, hk, dk), k.reshape(b, s, hk, dk), v.reshape(b, s, hv, dv), spans.join(g_PRTQ, s),
          spans.join(beta_PRTQ, s), segment_ids=segment_ids_BS)
    _, out_PRTD = spans.scan(functools.partial(self._output, w), None, (x_PRTD, spans.split(o_BSQX)))
    return spans.join(out_PRTD, s)

  def _weights(self, spans):
    """The weights in the compute dtype; before scans over spans, whole on every device (FSDP gathers them once,
    not once a span)."""
    whole = lambda w: w if spans.count == 1 else jax.lax.with_sharding_constraint(w, NamedSharding(self.mesh, P()))
    names = ("in_qkv_DC", "in_z_DC", "in_b_DC", "in_a_DC", "conv_CW", "out_CD")
    return {name: whole(self.cast(getattr(self, name))) for name in names}

  def _history(self, x_BSD, segment_ids_BS, split, w):
    """(the conv's inputs [R, W − 1, C], their segment ids [R, W − 1] or None) before each chunk: zeros before a
    row; under context parallelism the chunk before is another device's, its last positions gathered."""
    rows, b = self.config.linear_conv_kernel_dim - 1, x_BSD.shape[0]
    if not split:
      seg_RW = None if segment_ids_BS is None else jnp.zeros((b, rows), segment_ids_BS.dtype)
      return jnp.zeros((b, rows, w["in_qkv_DC"].shape[1]), x_BSD.dtype), seg_RW
    before = lambda x: preceding_rows(x, rows, mesh=self.mesh)
    seg_RW = None if segment_ids_BS is None else before(segment_ids_BS).reshape(-1, rows)
    with jax.named_scope("projection"):
      return before(x_BSD).reshape(-1, rows, x_BSD.shape[2]) @ w["in_qkv_DC"], seg_RW

  def _mix_inputs(self, w, history, xs):
    """One span: projection, conv (after the carried history), SiLU and the gates; carries the history on."""
    (qkv_RWC, seg_RW), (x_RTD, seg_RT) = history, xs
    rows = qkv_RWC.shape[1]
    with jax.named_scope("projection"):
      qkv_RTC = x_RTD @ w["in_qkv_DC"]
      beta_RTQ = jax.nn.sigmoid((x_RTD @ w["in_b_DC"]).astype(jnp.float32))
      a_RTQ = (x_RTD @ w["in_a_DC"]).astype(jnp.float32)
    with jax.named_scope("deltanet"):  # the step profile's part (`train.profile.step_parts`): conv, gates, rule
      wide_RWC = jnp.concatenate([qkv_RWC, qkv_RTC], axis=1)
      wide_seg = None if seg_RT is None else jnp.concatenate([seg_RW, seg_RT], axis=1)
      qkv_RTC = jax.nn.silu(causal_conv(wide_RWC, w["conv_CW"], wide_seg)[:, rows:])
      g_RTQ = -jnp.exp(self.a_log_Q[...].astype(jnp.float32)) * jax.nn.softplus(
          a_RTQ + self.dt_bias_Q[...].astype(jnp.float32))
    history = (wide_RWC[:, -rows:], None if wide_seg is None else wide_seg[:, -rows:])
    return history, (qkv_RTC, g_RTQ, beta_RTQ)

  def _output(self, w, carry, xs):
    """One span: the gate's projection, the gated norm, the output projection."""
    x_RTD, o_RTQX = xs
    c = self.config
    with jax.named_scope("projection"):
      z_RTQX = (x_RTD @ w["in_z_DC"]).reshape(o_RTQX.shape)
      o_RTQX = gated_rms_norm(o_RTQX, z_RTQX, self.norm_X[...], c.rms_norm_eps)
      return carry, o_RTQX.reshape(*o_RTQX.shape[:2], -1) @ w["out_CD"]
