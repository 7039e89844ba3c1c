"""Gated delta rule (the core of Gated DeltaNet) in pure JAX.

Per value head, with state S ∈ R^{K×V}, log decay g_t ≤ 0 and write strength β_t:

  S'_t = exp(g_t) S_{t-1},   u_t = β_t (v_t − S'_tᵀ k_t),   S_t = S'_t + k_t u_tᵀ,   o_t = S_tᵀ q_t.

Chunked form. In a chunk of C positions r, s let Γ = cumsum(g) within the chunk and
D_rs = exp(Γ_r − Γ_s) if s ≤ r and r, s lie in the same document, else 0. Then

  A = (diag(β) K Kᵀ) ⊙ D (strictly lower part),   P = (Q Kᵀ) ⊙ D,
  U = (I + A)⁻¹ diag(β) V,   W = (I + A)⁻¹ diag(β m exp(Γ)) K,
  V_new = U − W S,   O = (Q ⊙ m exp(Γ)) S + P V_new,
  S ← c exp(Γ_C) S + (K ⊙ e exp(Γ_C − Γ))ᵀ V_new,

where S is the state entering the chunk, m_r = [doc(r) = doc of S], e_s = [doc(s) = doc(C)]
and c = [doc(C) = doc of S]. A row's initial state belongs to its first document.

A chunk maps the state affinely, S ← M S + b, with M = c exp(Γ_C) I − (K ⊙ e exp(Γ_C − Γ))ᵀ W and
b = (K ⊙ e exp(Γ_C − Γ))ᵀ U; maps compose as (M₂, b₂)∘(M₁, b₁) = (M₂M₁, M₂b₁ + b₂). Context parallelism
by state passing: each shard computes its (M, b), the maps are all-gathered and prefix-combined into
every shard's initial state, and each shard reruns the chunked form from that state.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from models.attention import gated_delta_chunks as gdc
from models.attention.gated_delta_kernel_path import kernel_chunked_forward
from models.attention.gated_delta_kernels import operand_einsum


def _chunk_einsum(spec, a, b, dtype):
  """A state-independent matmul of the chunked form: float32 at full precision (dtype None), or `dtype` operands
  with float32 accumulation (fla's choice for bfloat16 models)."""
  return operand_einsum(spec, a, b, dtype or jnp.float32)


class _Chunks(NamedTuple):
  """Per-chunk quantities, [B, N, H, ...]."""
  qd_BNHCK: jax.Array  # Q ⊙ m exp(Γ): reads the incoming state
  kd_BNHCK: jax.Array  # K ⊙ e exp(Γ_C − Γ): writes the outgoing state
  p_BNHCC: jax.Array
  u_BNHCV: jax.Array
  w_BNHCK: jax.Array
  decay_BNH: jax.Array  # c exp(Γ_C)


def _chunk_quantities(q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH, seg_BS, chunk_size, l2_normalize, chunk_dtype=None):
  """Everything that does not depend on the state, for all chunks at once (`chunk_dtype`: see `_chunk_einsum`)."""
  q_BSHK, k_BSHK = gdc.prepare_qk(q_BSHK, k_BSHK, v_BSHV.shape[2], l2_normalize)
  to_BNHC = lambda x: jnp.moveaxis(gdc.to_chunks(x.astype(jnp.float32), chunk_size), 3, 2)
  q_BNHCK, k_BNHCK, v_BNHCV = to_BNHC(q_BSHK), to_BNHC(k_BSHK), to_BNHC(v_BSHV)
  g_BNHC, beta_BNHC = to_BNHC(g_BSH[..., None])[..., 0], to_BNHC(beta_BSH[..., None])[..., 0]
  masks = gdc.chunk_masks(seg_BS, chunk_size)
  reads_BN1C, writes_BN1C = masks.reads_BNC[:, :, None], masks.writes_BNC[:, :, None]
  keeps_BN1 = masks.keeps_BN[:, :, None]

  gamma_BNHC = jnp.cumsum(g_BNHC, axis=-1)
  decay_BNHCC = gdc.decays(gamma_BNHC, masks.sees_BNCC[:, :, None])
  gamma_end_BNH1 = gamma_BNHC[..., -1:]

  a_BNHCC = _chunk_einsum("bnhrk,bnhsk->bnhrs", k_BNHCK, k_BNHCK, chunk_dtype) * beta_BNHC[..., None] * decay_BNHCC
  inv_BNHCC = gdc.unit_lower_inverse(a_BNHCC)
  wk_BNHCK = k_BNHCK * (beta_BNHC * reads_BN1C * jnp.exp(gamma_BNHC))[..., None]
  return _Chunks(
      qd_BNHCK=q_BNHCK * (reads_BN1C * jnp.exp(gamma_BNHC))[..., None],
      kd_BNHCK=k_BNHCK * (writes_BN1C * jnp.exp(gamma_end_BNH1 - gamma_BNHC))[..., None],
      p_BNHCC=_chunk_einsum("bnhrk,bnhsk->bnhrs", q_BNHCK, k_BNHCK, chunk_dtype) * decay_BNHCC,
      u_BNHCV=_chunk_einsum("bnhrs,bnhsv->bnhrv", inv_BNHCC, v_BNHCV * beta_BNHC[..., None], chunk_dtype),
      w_BNHCK=_chunk_einsum("bnhrs,bnhsk->bnhrk", inv_BNHCC, wk_BNHCK, chunk_dtype),
      decay_BNH=keeps_BN1 * jnp.exp(gamma_end_BNH1[..., 0]),
  )


def _scan_chunks(chunks, state_BHKV):
  """Carries the state across chunks; returns (o [B, N·C, H, V], final state). The loop does only what needs the
  state it carries (V_new and the next state, `_state_loop`); the output reads each chunk's entering state
  afterwards, one batched matmul over all chunks (as fla's kernels split it)."""
  to_N = lambda x: jnp.moveaxis(x, 1, 0)
  states_NBHKV, vnew_NBHCV, state_BHKV = _state_loop(
      *(to_N(x) for x in (chunks.u_BNHCV, chunks.w_BNHCK, chunks.kd_BNHCK, chunks.decay_BNH)), state_BHKV)
  o_NBHCV = (gdc.einsum("nbhck,nbhkv->nbhcv", to_N(chunks.qd_BNHCK), states_NBHKV)
             + gdc.einsum("nbhrs,nbhsv->nbhrv", to_N(chunks.p_BNHCC), vnew_NBHCV))
  o_BNCHV = jnp.moveaxis(o_NBHCV, (0, 2), (1, 3))
  return o_BNCHV.reshape(o_BNCHV.shape[0], -1, *o_BNCHV.shape[3:]), state_BHKV


@jax.custom_vjp
def _state_loop(u_NBHCV, w_NBHCK, kd_NBHCK, decay_NBH, state_BHKV):
  """(each chunk's entering state S_n [N, B, H, K, V], V_new = U − W S_n [N, B, H, C, V], the final state), with
  S ← decay S + Kdᵀ V_new. Its VJP is written out: autodiff's reverse loop transposes four matmuls a chunk and keeps
  its own stack of the states beside the one returned; this one runs two (`_state_loop_bwd`)."""
  return _state_loop_fwd(u_NBHCV, w_NBHCK, kd_NBHCK, decay_NBH, state_BHKV)[0]


def _state_loop_fwd(u_NBHCV, w_NBHCK, kd_NBHCK, decay_NBH, state_BHKV):
  def step(state_BHKV, chunk):
    u_BHCV, w_BHCK, kd_BHCK, decay_BH = chunk
    vnew_BHCV = u_BHCV - gdc.einsum("bhck,bhkv->bhcv", w_BHCK, state_BHKV)
    next_BHKV = decay_BH[..., None, None] * state_BHKV + gdc.einsum("bhck,bhcv->bhkv", kd_BHCK, vnew_BHCV)
    return next_BHKV, (state_BHKV, vnew_BHCV)

  final_BHKV, (states_NBHKV, vnew_NBHCV) = lax.scan(step, state_BHKV, (u_NBHCV, w_NBHCK, kd_NBHCK, decay_NBH))
  return (states_NBHKV, vnew_NBHCV, final_BHKV), (w_NBHCK, kd_NBHCK, decay_NBH, states_NBHKV, vnew_NBHCV)


def _state_loop_bwd(residuals, cotangents):
  """Backwards over chunks with G = ∂L/∂S_{n+1}: ∂V_new_n = dV_new_n + Kd_n G, ∂S_n = decay_n G + dS_n − W_nᵀ ∂V_new_n;
  the rest batched after the loop: ∂U = ∂V_new, ∂W = −∂V_new S_nᵀ, ∂Kd = V_new Gᵀ, ∂decay = Σ G ⊙ S_n."""
  w_NBHCK, kd_NBHCK, decay_NBH, states_NBHKV, vnew_NBHCV = residuals
  dstates_NBHKV, dvnew_NBHCV, dfinal_BHKV = cotangents

  def step(g_BHKV, chunk):
    dvnew_BHCV, dstate_BHKV, w_BHCK, kd_BHCK, decay_BH = chunk
    dvnew_BHCV = dvnew_BHCV + gdc.einsum("bhck,bhkv->bhcv", kd_BHCK, g_BHKV)
    entering_BHKV = (decay_BH[..., None, None] * g_BHKV + dstate_BHKV
                     - gdc.einsum("bhck,bhcv->bhkv", w_BHCK, dvnew_BHCV))
    return entering_BHKV, (dvnew_BHCV, g_BHKV)

  dstate_BHKV, (dvnew_NBHCV, g_NBHKV) = lax.scan(
      step, dfinal_BHKV, (dvnew_NBHCV, dstates_NBHKV, w_NBHCK, kd_NBHCK, decay_NBH), reverse=True)
  dw_NBHCK = -gdc.einsum("nbhcv,nbhkv->nbhck", dvnew_NBHCV, states_NBHKV)
  dkd_NBHCK = gdc.einsum("nbhcv,nbhkv->nbhck", vnew_NBHCV, g_NBHKV)
  ddecay_NBH = jnp.sum(g_NBHKV * states_NBHKV, axis=(-2, -1))
  return dvnew_NBHCV, dw_NBHCK, dkd_NBHCK, ddecay_NBH, dstate_BHKV


_state_loop.defvjp(_state_loop_fwd, _state_loop_bwd)


STATE_KERNELS = ("xla", "pallas")


def _chunked_forward(q, k, v, g, beta, seg_BS, state_BHKV, chunk_size, l2_normalize, chunk_dtype):
  chunks = _chunk_quantities(q, k, v, g, beta, seg_BS, chunk_size, l2_normalize, chunk_dtype)
  o_BSHV, state_BHKV = _scan_chunks(chunks, state_BHKV.astype(jnp.float32))
  return o_BSHV[:, :v.shape[1]].astype(v.dtype), state_BHKV


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _chunked(q, k, v, g, beta, seg_BS, state_BHKV, chunk_size, l2_normalize, chunk_dtype):
  """The XLA form; its VJP keeps only the inputs and reruns the forward."""
  return _chunked_forward(q, k, v, g, beta, seg_BS, state_BHKV, chunk_size, l2_normalize, chunk_dtype)


def _chunked_fwd(q, k, v, g, beta, seg_BS, state_BHKV, chunk_size, l2_normalize, chunk_dtype):
  out = _chunked_forward(q, k, v, g, beta, seg_BS, state_BHKV, chunk_size, l2_normalize, chunk_dtype)
  # Only the inputs are kept: per-chunk states would cost N·H·K·V floats per sequence and layer.
  return out, (q, k, v, g, beta, seg_BS, state_BHKV)


def _chunked_bwd(chunk_size, l2_normalize, chunk_dtype, residuals, cotangents):
  q, k, v, g, beta, seg_BS, state_BHKV = residuals
  forward = lambda q, k, v, g, beta, s: _chunked_forward(
      q, k, v, g, beta, seg_BS, s, chunk_size, l2_normalize, chunk_dtype)
  _, vjp = jax.vjp(forward, q, k, v, g, beta, state_BHKV)
  dq, dk, dv, dg, dbeta, dstate = vjp(cotangents)
  return dq, dk, dv, dg, dbeta, None, dstate


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


def _initial_state(initial_state, v_BSHV, key_dim):
  batch, _, num_v_heads, value_dim = v_BSHV.shape
  zeros_BHKV = lambda: jnp.zeros((batch, num_v_heads, key_dim, value_dim), jnp.float32)
  return zeros_BHKV() if initial_state is None else initial_state


# A row's positions per pass of the chunked form. Its temporaries grow with the positions it holds, so a longer row
# runs as a scan over spans of this many, the state carried, its backward recomputing one span at a time (compiled
# for an H200, forward + backward of Qwen3.5's heads at 1 × 262144: the kernel path 17.13 GiB whole, 5.23 in spans;
# the XLA form 79.0 whole on an earlier version, 10.28 in spans; benchmarks/results/gated_deltanet_compile_only.txt).
# Compute is the same but for the kernel path's backward, which reruns a span's state pass where a whole row keeps
# it: at 1 × 65536 spans save 0.73 GiB (4.28 → 3.55) and cost that rerun (4.4 ms of 29.5 in one H100's profile); the
# A/B of the two times: `benchmarks.gated_deltanet --variants pallas,pallas_whole`.
SPAN_TOKENS = 32768


def _spans(rule, q, k, v, g, beta, seg_BS, state_BHKV, span):
  """`rule(q, k, v, g, beta, seg_BS, state_BHKV)` over each row's spans of `span` positions in turn, the state
  carried across and zeroed where a span begins a new document (a row's initial state reaches its first one)."""
  b, s = v.shape[:2]
  p = -(-s // span)
  pad = lambda x, mode="constant": jnp.pad(x, [(0, 0), (0, p * span - s)] + [(0, 0)] * (x.ndim - 2), mode=mode)
  to_PB = lambda x: jnp.moveaxis(x.reshape(b, p, span, *x.shape[2:]), 1, 0)
  # Padding joins the last document with g = β = 0: it leaves the final state as it is.
  seg_PBS = to_PB(pad(seg_BS, "edge"))
  before_PB = jnp.concatenate([seg_PBS[:1, :, 0], seg_PBS[:-1, :, -1]])
  keeps_PB = (seg_PBS[:, :, 0] == before_PB).astype(jnp.float32)

  def step(state_BHKV, x):
    q, k, v, g, beta, seg_BS, keep_B = x
    o_BSHV, state_BHKV = rule(q, k, v, g, beta, seg_BS, state_BHKV * keep_B[:, None, None, None])
    return state_BHKV, o_BSHV

  xs = (*(to_PB(pad(x)) for x in (q, k, v, g, beta)), seg_PBS, keeps_PB)
  state_BHKV, o_PBSHV = lax.scan(step, state_BHKV, xs)
  return jnp.moveaxis(o_PBSHV, 0, 1).reshape(b, p * span, *v.shape[2:])[:, :s], state_BHKV


def gated_delta_rule(q, k, v, g, beta, *, segment_ids=None, initial_state=None, chunk_size=64,
                     l2_normalize=True, output_final_state=False, state_kernel="xla", chunk_dtype=None,
                     span_tokens=SPAN_TOKENS):
  """Gated delta rule, chunked form, with a custom VJP that keeps the inputs and reruns the forward, except on the
  kernel path for a row in one span: there it keeps what the backward needs of the loop over chunks (each chunk's
  (I + A)⁻¹, W, entering state and V_new, about 4.5 times v's size at C = 64, K = V = 128) and reruns nothing.

  Args:
    q: queries [B, S, Hk, K].
    k: keys [B, S, Hk, K].
    v: values [B, S, Hv, V]; value head j uses key head j // (Hv // Hk).
    g: log decay [B, S, Hv], ≤ 0.
    beta: write strength [B, S, Hv].
    segment_ids: optional int [B, S], non-decreasing along S; the state restarts at each new
      document, and initial_state only reaches the first document of each row.
    initial_state: optional [B, Hv, K, V].
    chunk_size: chunk length C; S is padded to a multiple of it.
    l2_normalize: L2-normalise q and k over K first.
    output_final_state: also return the state after the last token.
    state_kernel: "xla": the chunked form in XLA, its loop over chunks a `lax.scan`; "pallas": the chunks'
      inverses, the loop over chunks and the output as Pallas kernels, the backward as five more (compiled on GPUs,
      in Pallas' interpreter elsewhere), every matmul on bfloat16 operands (float32 accumulation, state and decays)
      unless v is float32.
    chunk_dtype: the XLA form's matmuls that do not involve the state (K·Kᵀ, Q·Kᵀ, and (I + A)⁻¹ times βV and the
      decayed K): None in float32 at full precision; a dtype (bfloat16): their operands in it, accumulated in
      float32. The Pallas path ignores it.
    span_tokens: a row longer than this runs as a scan over spans of it (rounded to whole chunks), the state
      carried: the temporaries of one span, not of the row (None: the whole row at once).

  Returns:
    (o [B, S, Hv, V] in v's dtype, final state [B, Hv, K, V] float32 or None).
  """
  if state_kernel not in STATE_KERNELS:
    raise ValueError(f"state_kernel={state_kernel!r} is not one of {STATE_KERNELS}")
  gdc.check_inputs(q, k, v, g, beta, segment_ids, initial_state, chunk_size)
  seg_BS = gdc.segment_ids(segment_ids, v.shape[0], v.shape[1])
  state_BHKV = _initial_state(initial_state, v, k.shape[-1])
  span = None if span_tokens is None else max(chunk_size, span_tokens // chunk_size * chunk_size)
  in_spans = span is not None and v.shape[1] > span

  def rule(q, k, v, g, beta, seg_BS, state_BHKV):
    if state_kernel == "pallas":  # over spans, one span's state pass at a time: rerun in the backward
      return kernel_chunked_forward(q, k, v, g, beta, seg_BS, state_BHKV, chunk_size, l2_normalize,
                                    keep_state_pass=not in_spans)
    return _chunked(q, k, v, g, beta, seg_BS, state_BHKV, chunk_size, l2_normalize, chunk_dtype)

  if in_spans:
    o_BSHV, state_BHKV = _spans(rule, q, k, v, g, beta, seg_BS, state_BHKV, span)
  else:
    o_BSHV, state_BHKV = rule(q, k, v, g, beta, seg_BS, state_BHKV)
  return o_BSHV, (state_BHKV if output_final_state else None)


def recurrent_gated_delta_rule(q, k, v, g, beta, *, segment_ids=None, initial_state=None,
                               chunk_size=64, l2_normalize=True, output_final_state=False):
  """Token-by-token gated delta rule (the reference); arguments and returns as `gated_delta_rule`."""
  gdc.check_inputs(q, k, v, g, beta, segment_ids, initial_state, chunk_size)
  batch, seq_len = v.shape[:2]
  q_BSHK, k_BSHK = gdc.prepare_qk(q, k, v.shape[2], l2_normalize)
  seg_BS = gdc.segment_ids(segment_ids, batch, seq_len)
  keep_BS = jnp.concatenate(
      [jnp.ones((batch, 1), bool), seg_BS[:, 1:] == seg_BS[:, :-1]], axis=1).astype(jnp.float32)

  def step(state_BHKV, x):
    q_BHK, k_BHK, v_BHV, g_BH, beta_BH, keep_B = x
    state_BHKV = state_BHKV * (keep_B[:, None] * jnp.exp(g_BH))[..., None, None]
    u_BHV = beta_BH[..., None] * (v_BHV - gdc.einsum("bhkv,bhk->bhv", state_BHKV, k_BHK))
    state_BHKV = state_BHKV + k_BHK[..., :, None] * u_BHV[..., None, :]
    return state_BHKV, gdc.einsum("bhkv,bhk->bhv", state_BHKV, q_BHK)

  xs = [x.astype(jnp.float32) for x in (q_BSHK, k_BSHK, v, g, beta, keep_BS)]
  state_BHKV = _initial_state(initial_state, v, k.shape[-1]).astype(jnp.float32)
  state_BHKV, o_SBHV = lax.scan(step, state_BHKV, [jnp.moveaxis(x, 1, 0) for x in xs])
  o_BSHV = jnp.moveaxis(o_SBHV, 0, 1).astype(v.dtype)
  return o_BSHV, (state_BHKV if output_final_state else None)


def chunk_transition(q, k, v, g, beta, *, segment_ids=None, chunk_size=64, l2_normalize=True, state_kernel="xla",
                     span_tokens=SPAN_TOKENS):
  """Affine map of a whole sequence (shard) on the state: final = M @ initial + b.

  The rule's own final state from the initial state [I | 0] with values [0 | v] is [M | b] (the state's first K
  columns carry M, the rest b): one pass of `gated_delta_rule`, its spans and memory-lean VJP included.

  Args:
    q, k, v, g, beta, segment_ids, chunk_size, l2_normalize, state_kernel, span_tokens: as in `gated_delta_rule`.

  Returns:
    (M [B, Hv, K, K], b [B, Hv, K, V]), float32. M is zero if the sequence has a document
    boundary, since the initial state then cannot reach the final state.
  """
  key_dim = k.shape[-1]
  v_BSHW = widened_values(v, key_dim)
  # zeros_like: under shard_map the state varies over the mesh axes as the inputs do.
  first_BHKW = jnp.eye(key_dim, v_BSHW.shape[-1], dtype=jnp.float32) + jnp.zeros_like(
      v_BSHW[:, 0, :, None, :], jnp.float32)
  _, final_BHKW = gated_delta_rule(q, k, v_BSHW, g, beta, segment_ids=segment_ids, initial_state=first_BHKW,
                                   chunk_size=chunk_size, l2_normalize=l2_normalize, output_final_state=True,
                                   state_kernel=state_kernel, span_tokens=span_tokens)
  return final_BHKW[..., :key_dim], final_BHKW[..., key_dim:]


def widened_values(v, key_dim):
  """Values [0 | v] (K + V columns, any leading dims): from the state [M | b] of what came before, the rule's final
  state is [M | b] of it all; from [I | 0], the affine map of one pass (`chunk_transition`)."""
  return jnp.concatenate([jnp.zeros(v.shape[:-1] + (key_dim,), v.dtype), v], axis=-1)


def combine_transitions(ms, bs, *, initial_state=None, resets=None):
  """Initial state of every shard from the gathered shard maps (an exclusive prefix scan).

  Args:
    ms: [P, B, H, K, K], shard p's M from `chunk_transition`, shards in sequence order.
    bs: [P, B, H, K, V], shard p's b.
    initial_state: optional [B, H, K, V], the state before shard 0 (zeros if None).
    resets: optional bool [P, B]: shard p's first token starts a new document (its first
      segment id differs from the last one of shard p - 1), so it starts from zeros.
      resets[0] is ignored: the initial state belongs to the row's first document.

  Returns:
    [P, B, H, K, V] float32: the state entering each shard.
  """
  state_BHKV = jnp.zeros(bs.shape[1:], jnp.float32) if initial_state is None else initial_state
  keeps_PB = (jnp.ones(bs.shape[:2], bool) if resets is None else ~jnp.asarray(resets))

  def step(state_BHKV, x):
    m_BHKK, b_BHKV, keep_B = x
    new_BHKV = gdc.einsum("bhij,bhjv->bhiv", m_BHKK, state_BHKV) + b_BHKV
    return new_BHKV * keep_B[:, None, None, None], state_BHKV

  # keep of the next shard; the state after the last shard (unused) is never reset.
  keeps_next_PB = jnp.concatenate([keeps_PB[1:], jnp.ones_like(keeps_PB[:1])]).astype(jnp.float32)
  _, states_PBHKV = lax.scan(step, state_BHKV.astype(jnp.float32), (ms, bs, keeps_next_PB))
  return states_PBHKV
