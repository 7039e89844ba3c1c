"""Qwen3.5's Gated DeltaNet layer (`Qwen3_5MoeGatedDeltaNet`), in spans of the sequence when rows are long.

The layer: one projection to [q | k | v], a causal depthwise conv with SiLU, the gated delta rule
(`models.attention.gated_delta`) with β = sigmoid(b) and log decay g = −exp(A_log) · softplus(a + dt_bias), then an
RMSNorm gated by SiLU(z) and the output projection. Packed documents restart the conv window and the state.

Spans (`models.spans`). A row (under context parallelism each of its chunks, `models.attention.context_parallel`)
longer than `runtime.sequence_span_tokens` runs as a scan over spans of it, the whole layer per span: the projection
and conv after the conv's last W − 1 inputs carried from the span before (a chunk's first span gets them from the
chunk before it in the sequence, `preceding_rows`), the rule from the carried state, the gated norm and the output
projection. Each step is rematerialised: backward recomputes one span at a time, so the layer's [positions, 8192]
tensors exist a span at a time, not a dozen times over the row (forward and backward copies of the projection,
conv, SiLU, split and their float32 gradients), for one more forward of the layer in backward. Under context
parallelism a first scan carries each chunk's state map instead ([M | b], the rule's state from [I | 0] with values
[0 | v]), the maps cross the devices (`entering_states`), and the second scan starts each chunk from its entering
state. A row of one span runs the layer at once, nothing recomputed.

Shape letters: see `relaymoe_jax`; in this layer N counts a row's chunks, T a span's positions, X a key head's width,
W the conv window (and K + V columns of [M | b]), P spans.
"""

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from models.attention.context_parallel import splits_sequences
from models.attention.gated_delta import gated_delta_rule, widened_values
from models.attention.gated_delta_context import (context_gated_delta_rule, entering_states, on_row_shards,
                                                  preceding_rows)
from models.qwen3.layer import Layer
from models.sharding import batch_axes, make_param
from models.spans import Spans
from relaymoe_jax.axes import DATA, EXPERT


def gated_rms_norm(x, gate, weight, eps):
  """The DeltaNet's output norm: RMSNorm (scale `weight`, not zero-centred) times SiLU(gate) in float32."""
  x32 = x.astype(jnp.float32)
  y = (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)
  return (weight.astype(x.dtype) * y * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)


def causal_conv(x_BSC, w_CW, segment_ids_BS=None):
  """Depthwise causal conv over S (Hugging Face's conv1d with W − 1 zeros of left padding): out[t] = Σ_j w[:, j] ·
  x[t − (W − 1) + j], inputs from another document (`segment_ids_BS`) or before the row read as zeros. Any leading
  dims: x [..., S, C], segment ids [..., S]."""
  width, length = w_CW.shape[1], x_BSC.shape[-2]
  out = jnp.zeros(x_BSC.shape, jnp.float32)
  for j in range(width):
    shift = width - 1 - j
    shifted = jnp.pad(x_BSC, [(0, 0)] * (x_BSC.ndim - 2) + [(shift, 0), (0, 0)])[..., :length, :]
    if segment_ids_BS is not None and shift:
      before = jnp.pad(segment_ids_BS, [(0, 0)] * (segment_ids_BS.ndim - 1) + [(shift, 0)], constant_values=-1)
      shifted = jnp.where((segment_ids_BS == before[..., :-shift])[..., None], shifted, 0)
    out = out + shifted.astype(jnp.float32) * w_CW[:, j].astype(jnp.float32)
  return out.astype(x_BSC.dtype)


def delta_state_kernel(runtime, platform):
  """The gated delta rule's loop over chunks: the Pallas kernels on GPUs (not with
  runtime.attention_implementation=xla), XLA's scan elsewhere."""
  on = platform == "gpu" and runtime.attention_implementation != "xla"
  return "pallas" if on else "xla"


def delta_rule(runtime, mesh):
  """The gated delta rule on whole rows (the layer has cut long ones into spans already) as `runtime` runs it on
  `mesh`: split over sequences (context parallelism: state passing), or the Pallas kernels on each device's rows (XLA
  cannot partition them), or XLA's form on the whole batch."""
  kernel = delta_state_kernel(runtime, mesh.devices.flat[0].platform)
  rule = dict(state_kernel=kernel, span_tokens=None)
  if splits_sequences(runtime, mesh):
    return functools.partial(context_gated_delta_rule, mesh=mesh, **rule)
  if kernel == "xla":
    return functools.partial(gated_delta_rule, **rule)
  return functools.partial(on_row_shards, functools.partial(gated_delta_rule, **rule), mesh=mesh,
                           spec=P(batch_axes(runtime)))


class GatedDeltaNet(Layer):
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
    split = splits_sequences(self.runtime, self.mesh)
    spans = Spans.of_run(x_BSD.shape[1], self.runtime, self.mesh)
    w = self._weights(spans)
    history = self._history(x_BSD, segment_ids_BS, split, w)
    if spans.count == 1:
      return self._whole(w, history, x_BSD, segment_ids_BS)
    return self._in_spans(spans, w, history, x_BSD, segment_ids_BS, split)

  def _whole(self, w, history, x_BSD, segment_ids_BS):
    """Rows at once: projections and conv, the rule (across chunks under context parallelism), the output."""
    b, s, _ = x_BSD.shape
    chunks = lambda x: None if x is None else x.reshape(b, history[0].shape[1], -1, *x.shape[2:])
    _, qkvgb = self._mix_inputs(w, history, (chunks(x_BSD), chunks(segment_ids_BS)))
    with jax.named_scope("deltanet"):
      o_BSQX, _ = delta_rule(self.runtime, self.mesh)(*(x.reshape(b, s, *x.shape[3:]) for x in qkvgb),
                                                      segment_ids=segment_ids_BS)
    return self._output(w, x_BSD, o_BSQX)

  def _in_spans(self, spans, w, history, x_BSD, segment_ids_BS, split):
    """Each chunk as a scan over its spans, the conv's history and the delta state carried; under context
    parallelism a first scan gives each chunk's state map, the maps cross the devices, and the second starts each
    chunk from its entering state."""
    seg_PBNT = None if segment_ids_BS is None else spans.split(segment_ids_BS)
    xs = (spans.split(x_BSD), seg_PBNT, spans.positions())
    c = self.config
    k, v = c.linear_key_head_dim, c.linear_value_head_dim
    rows = (x_BSD.shape[0], spans.chunks, c.linear_num_value_heads, k)
    state_BNQXV = jnp.zeros((*rows, v), jnp.float32)
    if split:
      first_BNQXW = jnp.broadcast_to(jnp.eye(k, k + v), (*rows, k + v))  # [M | b] = [I | 0]
      (_, finals_BNQXW), _ = spans.scan(functools.partial(self._span, w, True), (history, first_BNQXW), xs)
      with jax.named_scope("deltanet"):
        state_BNQXV = entering_states(finals_BNQXW, mesh=self.mesh, segment_ids_BS=segment_ids_BS)
    _, out_PBNTD = spans.scan(functools.partial(self._span, w, False), (history, state_BNQXV), xs)
    return spans.join(out_PBNTD)

  def _span(self, w, transition, carry, xs):
    """One span of every chunk: the rule from the carried state (zeroed where the span begins a document), the
    layer's output; or (`transition`) no output, the state [M | b] of values [0 | v] carried instead."""
    (history, state_BNQXW), (x_BNTD, seg_BNT, kept_11T) = carry, xs
    seg_before_BNW = history[1]
    history, (q, k, v, g, beta) = self._mix_inputs(w, history, (x_BNTD, seg_BNT))
    with jax.named_scope("deltanet"):
      g, beta = g * kept_11T[..., None], beta * kept_11T[..., None]  # padding leaves the state as it is
      if seg_BNT is not None:
        state_BNQXW = state_BNQXW * (seg_BNT[..., 0] == seg_before_BNW[..., -1])[..., None, None, None]
      if transition:
        v = widened_values(v, k.shape[-1])
      o_BNTQX, state_BNQXW = self._span_rule(q, k, v, g, beta, seg_BNT, state_BNQXW)
    return (history, state_BNQXW), (None if transition else self._output(w, x_BNTD, o_BNTQX))

  def _span_rule(self, q, k, v, g, beta, seg_BNT, state_BNQXW):
    """The rule on [B, N, T, ...] from and to a state, on each device's rows of chunks (its Pallas kernels cannot be
    partitioned by XLA, and XLA would merge B and N by moving rows)."""
    kernel = delta_state_kernel(self.runtime, self.mesh.devices.flat[0].platform)
    spec = P(DATA, EXPERT) if splits_sequences(self.runtime, self.mesh) else P(batch_axes(self.runtime), None)
    rule = functools.partial(gated_delta_rule, state_kernel=kernel, span_tokens=None)
    return on_row_shards(rule, q, k, v, g, beta, mesh=self.mesh, spec=spec, segment_ids=seg_BNT,
                         initial_state=state_BNQXW, output_final_state=True, check_vma=kernel == "xla")

  def _weights(self, spans):
    """The weights in the compute dtype; before scans over spans, whole on every device (FSDP gathers them once,
    not once a span)."""
    names = ("in_qkv_DC", "in_z_DC", "in_b_DC", "in_a_DC", "conv_CW", "out_CD")
    return {name: spans.whole(self.cast(getattr(self, name)), self.mesh) for name in names}

  def _history(self, x_BSD, segment_ids_BS, split, w):
    """(the conv's inputs [B, N, W − 1, C], their segment ids [B, N, W − 1] or None) before each chunk: zeros before a
    row; under context parallelism the chunk before is another device's, its last positions gathered."""
    rows, b = self.config.linear_conv_kernel_dim - 1, x_BSD.shape[0]
    if not split:
      seg_BNW = None if segment_ids_BS is None else jnp.zeros((b, 1, rows), segment_ids_BS.dtype)
      return jnp.zeros((b, 1, rows, w["in_qkv_DC"].shape[1]), x_BSD.dtype), seg_BNW
    before = lambda x: (lambda y: y.reshape(b, -1, rows, *y.shape[2:]))(preceding_rows(x, rows, mesh=self.mesh))
    seg_BNW = None if segment_ids_BS is None else before(segment_ids_BS)
    with jax.named_scope("projection"):
      return before(x_BSD) @ w["in_qkv_DC"], seg_BNW

  def _mix_inputs(self, w, history, xs):
    """[B, N, T] positions after the conv's `history`: projection, conv, SiLU and the gates, (q, k, v with heads, g, β);
    the history carried on."""
    (qkv_BNWC, seg_BNW), (x_BNTD, seg_BNT) = history, xs
    c, rows = self.config, qkv_BNWC.shape[2]
    with jax.named_scope("projection"):
      qkv_BNTC = x_BNTD @ w["in_qkv_DC"]
      beta_BNTQ = jax.nn.sigmoid((x_BNTD @ w["in_b_DC"]).astype(jnp.float32))
      a_BNTQ = (x_BNTD @ w["in_a_DC"]).astype(jnp.float32)
    with jax.named_scope("deltanet"):  # the step profile's part (`train.profile.step_parts`): conv, gates, rule
      wide_BNWC = jnp.concatenate([qkv_BNWC, qkv_BNTC], axis=2)
      wide_seg = None if seg_BNT is None else jnp.concatenate([seg_BNW, seg_BNT], axis=2)
      qkv_BNTC = jax.nn.silu(causal_conv(wide_BNWC, w["conv_CW"], wide_seg)[:, :, rows:])
      g_BNTQ = -jnp.exp(self.a_log_Q[...].astype(jnp.float32)) * jax.nn.softplus(
          a_BNTQ + self.dt_bias_Q[...].astype(jnp.float32))
    history = (wide_BNWC[:, :, -rows:], None if wide_seg is None else wide_seg[:, :, -rows:])
    hk, dk, dv = c.linear_num_key_heads, c.linear_key_head_dim, c.linear_value_head_dim
    q, k, v = jnp.split(qkv_BNTC, [hk * dk, 2 * hk * dk], axis=-1)
    heads = lambda x, width: x.reshape(*x.shape[:3], -1, width)
    return history, (heads(q, dk), heads(k, dk), heads(v, dv), g_BNTQ, beta_BNTQ)

  def _output(self, w, x, o):
    """Positions ([B, S] or [B, N, T]): the gate's projection, the gated norm, the output projection."""
    with jax.named_scope("projection"):
      z = (x @ w["in_z_DC"]).reshape(o.shape)
      o = gated_rms_norm(o, z, self.norm_X[...], self.config.rms_norm_eps)
      return o.reshape(*o.shape[:-2], -1) @ w["out_CD"]
