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

from models.attention.gated_delta_kernels import BLOCK, operand_einsum, state_pass, unit_lower_inverse

# Matching float32 references needs full float32 matmuls; DEFAULT precision may use TF32 on GPUs.
_PRECISION = lax.Precision.HIGHEST


def _einsum(spec, *operands):
  return jnp.einsum(spec, *operands, precision=_PRECISION)


def _chunk_einsum(spec, a, b, dtype):
  """A state-independent matmul of the chunked form: float32 at full precision (dtype None), or `dtype` operands
  with float32 accumulation (fla's choice for bfloat16 models)."""
  return operand_einsum(spec, a, b, dtype or jnp.float32)


def _l2_normalize(x_BSHK):
  return x_BSHK * lax.rsqrt(jnp.sum(x_BSHK * x_BSHK, axis=-1, keepdims=True) + 1e-6)


def _normalize_qk(q_BSGK, k_BSGK, num_v_heads, l2_normalize):
  """float32, optional L2 norm, q scaled by K^-1/2; the key heads' count checked against the value heads'."""
  if num_v_heads % k_BSGK.shape[2]:
    raise ValueError(f"{num_v_heads} value heads are not a multiple of {k_BSGK.shape[2]} key heads")
  q_BSGK, k_BSGK = q_BSGK.astype(jnp.float32), k_BSGK.astype(jnp.float32)
  if l2_normalize:
    q_BSGK, k_BSGK = _l2_normalize(q_BSGK), _l2_normalize(k_BSGK)
  return q_BSGK * q_BSGK.shape[-1] ** -0.5, k_BSGK


def _prepare_qk(q_BSGK, k_BSGK, num_v_heads, l2_normalize):
  """`_normalize_qk`, key heads repeated to value heads."""
  q_BSGK, k_BSGK = _normalize_qk(q_BSGK, k_BSGK, num_v_heads, l2_normalize)
  repeats = num_v_heads // k_BSGK.shape[2]
  return jnp.repeat(q_BSGK, repeats, axis=2), jnp.repeat(k_BSGK, repeats, axis=2)


def _segment_ids(segment_ids_BS, batch, seq_len):
  return jnp.zeros((batch, seq_len), jnp.int32) if segment_ids_BS is None else jnp.asarray(segment_ids_BS)


def _to_chunks(x_BS, chunk_size, mode="constant"):
  """[B, S, ...] → [B, N, C, ...], right-padding S to a multiple of C."""
  pad = -x_BS.shape[1] % chunk_size
  x_BS = jnp.pad(x_BS, [(0, 0), (0, pad)] + [(0, 0)] * (x_BS.ndim - 2), mode=mode)
  return x_BS.reshape(x_BS.shape[0], -1, chunk_size, *x_BS.shape[2:])


def _diagonal_blocks(x_XCC, size):
  """[..., C, C] → [..., C / size, size, size], the blocks on the diagonal."""
  n = x_XCC.shape[-1] // size
  x_XnsNs = x_XCC.reshape(x_XCC.shape[:-2] + (n, size, n, size))
  return jnp.moveaxis(jnp.diagonal(x_XnsNs, axis1=-4, axis2=-2), -1, -3)


def _unit_lower_inverse(a_XCC):
  """(I + strictly_lower(A))⁻¹ by merging diagonal blocks of doubling size.

  [[T₁, 0], [−T₂ A₂₁ T₁, T₂]] inverts [[I + A₁₁, 0], [A₂₁, I + A₂₂]]: log2(C) rounds of
  batched matmuls. Not jax.scipy.linalg.solve_triangular: on CPU it lowers to a LAPACK custom
  call that intermittently hung the XLA runtime (jaxlib 0.10.2) inside the backward pass.
  """
  c = a_XCC.shape[-1]
  padded = 1 << (c - 1).bit_length()
  a_XPP = jnp.pad(jnp.tril(a_XCC, -1), [(0, 0)] * (a_XCC.ndim - 2) + [(0, padded - c)] * 2)
  inv_XNss = jnp.ones(a_XPP.shape[:-2] + (padded, 1, 1), a_XPP.dtype)
  size = 1
  while size < padded:
    t1_XNss, t2_XNss = inv_XNss[..., 0::2, :, :], inv_XNss[..., 1::2, :, :]
    a21_XNss = _diagonal_blocks(a_XPP, 2 * size)[..., size:, :size]
    t21_XNss = -_einsum("...ij,...jk,...kl->...il", t2_XNss, a21_XNss, t1_XNss)
    inv_XNss = jnp.concatenate([
        jnp.concatenate([t1_XNss, jnp.zeros_like(t1_XNss)], axis=-1),
        jnp.concatenate([t21_XNss, t2_XNss], axis=-1),
    ], axis=-2)
    size *= 2
  return inv_XNss[..., 0, :c, :c]


class _Chunks(NamedTuple):
  """Per-chunk quantities, [B, N, H, ...]."""
  qd_BNHCK: jax.Array  # Q ⊙ m exp(Γ): reads the incoming state
  kd_BNHCK: jax.Array  # K ⊙ e exp(Γ_C − Γ): writes the outgoing state
  p_BNHCC: jax.Array
  u_BNHCV: jax.Array
  w_BNHCK: jax.Array
  decay_BNH: jax.Array  # c exp(Γ_C)


class _Masks(NamedTuple):
  """Where documents let chunk positions see each other and the state, as float32 0/1."""
  sees_BNCC: jax.Array  # s ≤ r in the same document
  reads_BNC: jax.Array  # m: position r lies in the incoming state's document
  writes_BNC: jax.Array  # e: position s lies in the chunk's last document
  keeps_BN: jax.Array  # c: the chunk's last document is the incoming state's


def _chunk_masks(seg_BS, chunk_size):
  # Padding joins the last document, so with g = β = 0 it leaves that document's state intact.
  seg_BNC = _to_chunks(seg_BS, chunk_size, mode="edge")
  seg_in_BN = jnp.concatenate([seg_BNC[:, :1, 0], seg_BNC[:, :-1, -1]], axis=1)
  same_BNCC = seg_BNC[..., :, None] == seg_BNC[..., None, :]
  return _Masks(sees_BNCC=same_BNCC & jnp.tril(jnp.ones((chunk_size, chunk_size), bool)),
                reads_BNC=(seg_BNC == seg_in_BN[..., None]).astype(jnp.float32),
                writes_BNC=(seg_BNC == seg_BNC[..., -1:]).astype(jnp.float32),
                keeps_BN=(seg_BNC[..., -1] == seg_in_BN).astype(jnp.float32))


def _decays(gamma_XC, sees_XCC):
  """exp(Γ_r − Γ_s) where s sees r, else 0; masking before exp keeps exp(positive) overflow out of both the values
  and the gradients."""
  diff_XCC = gamma_XC[..., :, None] - gamma_XC[..., None, :]
  return jnp.where(sees_XCC, jnp.exp(jnp.where(sees_XCC, diff_XCC, 0.0)), 0.0)


def _chunk_quantities(q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH, seg_BS, chunk_size, l2_normalize, chunk_dtype=None):
  """Everything that does not depend on the state, for all chunks at once (`chunk_dtype`: see `_chunk_einsum`)."""
  q_BSHK, k_BSHK = _prepare_qk(q_BSHK, k_BSHK, v_BSHV.shape[2], l2_normalize)
  to_BNHC = lambda x: jnp.moveaxis(_to_chunks(x.astype(jnp.float32), chunk_size), 3, 2)
  q_BNHCK, k_BNHCK, v_BNHCV = to_BNHC(q_BSHK), to_BNHC(k_BSHK), to_BNHC(v_BSHV)
  g_BNHC, beta_BNHC = to_BNHC(g_BSH[..., None])[..., 0], to_BNHC(beta_BSH[..., None])[..., 0]
  masks = _chunk_masks(seg_BS, chunk_size)
  reads_BN1C, writes_BN1C = masks.reads_BNC[:, :, None], masks.writes_BNC[:, :, None]
  keeps_BN1 = masks.keeps_BN[:, :, None]

  gamma_BNHC = jnp.cumsum(g_BNHC, axis=-1)
  decay_BNHCC = _decays(gamma_BNHC, masks.sees_BNCC[:, :, None])
  gamma_end_BNH1 = gamma_BNHC[..., -1:]

  a_BNHCC = _chunk_einsum("bnhrk,bnhsk->bnhrs", k_BNHCK, k_BNHCK, chunk_dtype) * beta_BNHC[..., None] * decay_BNHCC
  inv_BNHCC = _unit_lower_inverse(a_BNHCC)
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
  """Carries the state across chunks; returns (o [B, N·C, H, V], final state)."""

  def step(state_BHKV, chunk):  # one chunk: the fields lose their N axis
    vnew_BHCV = chunk.u_BNHCV - _einsum("bhck,bhkv->bhcv", chunk.w_BNHCK, state_BHKV)
    o_BHCV = (_einsum("bhck,bhkv->bhcv", chunk.qd_BNHCK, state_BHKV)
              + _einsum("bhrs,bhsv->bhrv", chunk.p_BNHCC, vnew_BHCV))
    state_BHKV = (chunk.decay_BNH[..., None, None] * state_BHKV
                  + _einsum("bhck,bhcv->bhkv", chunk.kd_BNHCK, vnew_BHCV))
    return state_BHKV, o_BHCV

  chunks_N = jax.tree.map(lambda x: jnp.moveaxis(x, 1, 0), chunks)
  state_BHKV, o_NBHCV = lax.scan(step, state_BHKV, chunks_N)
  o_BNCHV = jnp.moveaxis(o_NBHCV, (0, 2), (1, 3))
  return o_BNCHV.reshape(o_BNCHV.shape[0], -1, *o_BNCHV.shape[3:]), state_BHKV


def _kernel_chunked_forward(q, k, v, g, beta, seg_BS, state_BHKV, chunk_size, l2_normalize):
  """The chunked form with the Pallas kernels (`gated_delta_kernels`): the inverses and the loop over chunks as
  kernels, the rest XLA's batched matmuls over (row, chunk, head), q and k at their key heads (value head h = key
  head g, repeat r); operands bfloat16 unless v is float32. Returns (o [B, S, H, V] in v's dtype, final state)."""
  dtype = jnp.float32 if v.dtype == jnp.float32 else jnp.bfloat16
  interpret = jax.default_backend() != "gpu"
  mm = functools.partial(operand_einsum, dtype=dtype)
  b, s, hk, _ = k.shape
  hv, dv = v.shape[2:]
  r = hv // hk
  q_BSGK, k_BSGK = _normalize_qk(q, k, hv, l2_normalize)
  q_BNCGK, k_BNCGK = (_to_chunks(x, chunk_size).astype(dtype) for x in (q_BSGK, k_BSGK))
  n = q_BNCGK.shape[1]
  by_key_head = lambda x_BSH: _to_chunks(x_BSH.astype(jnp.float32), chunk_size).reshape(b, n, chunk_size, hk, r)
  gamma_BNCGR, beta_BNCGR = jnp.cumsum(by_key_head(g), axis=2), by_key_head(beta)
  v_BNCGRV = _to_chunks(v, chunk_size).reshape(b, n, chunk_size, hk, r, dv)
  masks = _chunk_masks(seg_BS, chunk_size)
  per_position = lambda x_BNC: x_BNC[..., None, None]  # [B, N, C, 1, 1] against [B, N, C, G, R]

  gamma_end_BNGR = gamma_BNCGR[:, :, -1]
  decay_BNGRCC = _decays(jnp.moveaxis(gamma_BNCGR, 2, -1), masks.sees_BNCC[:, :, None, None])
  kk_BNG1CC = mm("bncgk,bnsgk->bngcs", k_BNCGK, k_BNCGK)[:, :, :, None]
  a_BNGRCC = kk_BNG1CC * jnp.moveaxis(beta_BNCGR, 2, -1)[..., None] * decay_BNGRCC
  t_BNGRCC = (unit_lower_inverse(a_BNGRCC, dtype, interpret) if chunk_size % BLOCK == 0
              else _unit_lower_inverse(a_BNGRCC))
  scaled = lambda x_BNCGK, scale_BNCGR: (x_BNCGK[:, :, :, :, None] * scale_BNCGR[..., None]).astype(dtype)
  xw_BNCGRK = scaled(k_BNCGK, beta_BNCGR * per_position(masks.reads_BNC) * jnp.exp(gamma_BNCGR))
  u_BNCGRV = mm("bngrcs,bnsgrv->bncgrv", t_BNGRCC, v_BNCGRV * beta_BNCGR[..., None]).astype(dtype)
  w_BNCGRK = mm("bngrcs,bnsgrk->bncgrk", t_BNGRCC, xw_BNCGRK).astype(dtype)
  kd_BNCGRK = scaled(k_BNCGK, per_position(masks.writes_BNC) * jnp.exp(gamma_end_BNGR[:, :, None] - gamma_BNCGR))
  decay_BNGR = masks.keeps_BN[..., None, None] * jnp.exp(gamma_end_BNGR)
  heads = lambda x: x.reshape(*x.shape[:3], hv, x.shape[-1])  # [B, N, C, G, R, ·] → [B, N, C, H, ·]
  states_BNHKV, vnew_BNCHV, state_BHKV = state_pass(
      heads(kd_BNCGRK), heads(w_BNCGRK), heads(u_BNCGRV), jnp.moveaxis(decay_BNGR.reshape(b, n, hv), 1, 2),
      state_BHKV, dtype, interpret)

  qd_BNCGRK = scaled(q_BNCGK, per_position(masks.reads_BNC) * jnp.exp(gamma_BNCGR))
  p_BNGRCC = mm("bncgk,bnsgk->bngcs", q_BNCGK, k_BNCGK)[:, :, :, None] * decay_BNGRCC
  o_BNCGRV = (mm("bncgrk,bngrkv->bncgrv", qd_BNCGRK, states_BNHKV.reshape(b, n, hk, r, *states_BNHKV.shape[-2:]))
              + mm("bngrcs,bnsgrv->bncgrv", p_BNGRCC, vnew_BNCHV.reshape(b, n, chunk_size, hk, r, dv)))
  return o_BNCGRV.reshape(b, n * chunk_size, hv, dv)[:, :s].astype(v.dtype), state_BHKV


STATE_KERNELS = ("xla", "pallas")


def _chunked_forward(q, k, v, g, beta, seg_BS, state_BHKV, chunk_size, l2_normalize, state_kernel, chunk_dtype):
  if state_kernel == "pallas":
    return _kernel_chunked_forward(q, k, v, g, beta, seg_BS, state_BHKV.astype(jnp.float32), chunk_size,
                                   l2_normalize)
  chunks = _chunk_quantities(q, k, v, g, beta, seg_BS, chunk_size, l2_normalize, chunk_dtype)
  o_BSHV, state_BHKV = _scan_chunks(chunks, state_BHKV.astype(jnp.float32))
  return o_BSHV[:, :v.shape[1]].astype(v.dtype), state_BHKV


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10))
def _chunked(q, k, v, g, beta, seg_BS, state_BHKV, chunk_size, l2_normalize, state_kernel, chunk_dtype):
  return _chunked_forward(q, k, v, g, beta, seg_BS, state_BHKV, chunk_size, l2_normalize, state_kernel, chunk_dtype)


def _chunked_fwd(q, k, v, g, beta, seg_BS, state_BHKV, chunk_size, l2_normalize, state_kernel, chunk_dtype):
  out = _chunked_forward(q, k, v, g, beta, seg_BS, state_BHKV, chunk_size, l2_normalize, state_kernel, chunk_dtype)
  # Only the inputs are kept: per-chunk states would cost N·H·K·V floats per sequence and layer.
  return out, (q, k, v, g, beta, seg_BS, state_BHKV)


def _chunked_bwd(chunk_size, l2_normalize, state_kernel, chunk_dtype, residuals, cotangents):
  q, k, v, g, beta, seg_BS, state_BHKV = residuals
  forward = lambda q, k, v, g, beta, s: _chunked_forward(
      q, k, v, g, beta, seg_BS, s, chunk_size, l2_normalize, state_kernel, chunk_dtype)
  _, vjp = jax.vjp(forward, q, k, v, g, beta, state_BHKV)
  dq, dk, dv, dg, dbeta, dstate = vjp(cotangents)
  return dq, dk, dv, dg, dbeta, None, dstate


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


def _initial_state(initial_state, v_BSHV, key_dim):
  batch, _, num_v_heads, value_dim = v_BSHV.shape
  zeros_BHKV = lambda: jnp.zeros((batch, num_v_heads, key_dim, value_dim), jnp.float32)
  return zeros_BHKV() if initial_state is None else initial_state


def gated_delta_rule(q, k, v, g, beta, *, segment_ids=None, initial_state=None, chunk_size=64,
                     l2_normalize=True, output_final_state=False, state_kernel="xla", chunk_dtype=None):
  """Gated delta rule, chunked form, with a memory-lean custom VJP.

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
      inverses and the loop over chunks as Pallas kernels (compiled on GPUs, in Pallas' interpreter elsewhere), the
      rest XLA's batched matmuls, every matmul on bfloat16 operands (float32 accumulation, state and decays)
      unless v is float32.
    chunk_dtype: the XLA form's matmuls that do not involve the state (K·Kᵀ, Q·Kᵀ, and (I + A)⁻¹ times βV and the
      decayed K): None in float32 at full precision; a dtype (bfloat16): their operands in it, accumulated in
      float32. The Pallas path ignores it.

  Returns:
    (o [B, S, Hv, V] in v's dtype, final state [B, Hv, K, V] float32 or None).
  """
  if state_kernel not in STATE_KERNELS:
    raise ValueError(f"state_kernel={state_kernel!r} is not one of {STATE_KERNELS}")
  seg_BS = _segment_ids(segment_ids, v.shape[0], v.shape[1])
  state_BHKV = _initial_state(initial_state, v, k.shape[-1])
  o_BSHV, state_BHKV = _chunked(q, k, v, g, beta, seg_BS, state_BHKV, chunk_size, l2_normalize, state_kernel,
                                chunk_dtype)
  return o_BSHV, (state_BHKV if output_final_state else None)


def recurrent_gated_delta_rule(q, k, v, g, beta, *, segment_ids=None, initial_state=None,
                               chunk_size=64, l2_normalize=True, output_final_state=False):
  """Token-by-token gated delta rule (the reference); arguments and returns as `gated_delta_rule`."""
  del chunk_size
  batch, seq_len = v.shape[:2]
  q_BSHK, k_BSHK = _prepare_qk(q, k, v.shape[2], l2_normalize)
  seg_BS = _segment_ids(segment_ids, batch, seq_len)
  keep_BS = jnp.concatenate(
      [jnp.ones((batch, 1), bool), seg_BS[:, 1:] == seg_BS[:, :-1]], axis=1).astype(jnp.float32)

  def step(state_BHKV, x):
    q_BHK, k_BHK, v_BHV, g_BH, beta_BH, keep_B = x
    state_BHKV = state_BHKV * (keep_B[:, None] * jnp.exp(g_BH))[..., None, None]
    u_BHV = beta_BH[..., None] * (v_BHV - _einsum("bhkv,bhk->bhv", state_BHKV, k_BHK))
    state_BHKV = state_BHKV + k_BHK[..., :, None] * u_BHV[..., None, :]
    return state_BHKV, _einsum("bhkv,bhk->bhv", state_BHKV, q_BHK)

  xs = [x.astype(jnp.float32) for x in (q_BSHK, k_BSHK, v, g, beta, keep_BS)]
  state_BHKV = _initial_state(initial_state, v, k.shape[-1]).astype(jnp.float32)
  state_BHKV, o_SBHV = lax.scan(step, state_BHKV, [jnp.moveaxis(x, 1, 0) for x in xs])
  o_BSHV = jnp.moveaxis(o_SBHV, 0, 1).astype(v.dtype)
  return o_BSHV, (state_BHKV if output_final_state else None)


def chunk_transition(q, k, v, g, beta, *, segment_ids=None, chunk_size=64, l2_normalize=True):
  """Affine map of a whole sequence (shard) on the state: final = M @ initial + b.

  Args:
    q, k, v, g, beta, segment_ids, chunk_size, l2_normalize: as in `gated_delta_rule`.

  Returns:
    (M [B, Hv, K, K], b [B, Hv, K, V]), float32. M is zero if the sequence has a document
    boundary, since the initial state then cannot reach the final state.
  """
  seg_BS = _segment_ids(segment_ids, v.shape[0], v.shape[1])
  chunks = _chunk_quantities(q, k, v, g, beta, seg_BS, chunk_size, l2_normalize)
  eye_KK = jnp.eye(k.shape[-1], dtype=jnp.float32)
  m_BNHKK = (chunks.decay_BNH[..., None, None] * eye_KK
             - _einsum("bnhck,bnhcj->bnhkj", chunks.kd_BNHCK, chunks.w_BNHCK))
  b_BNHKV = _einsum("bnhck,bnhcv->bnhkv", chunks.kd_BNHCK, chunks.u_BNHCV)

  def step(carry, x):
    m_BHKK, b_BHKV = carry
    mn_BHKK, bn_BHKV = x
    return (_einsum("bhij,bhjk->bhik", mn_BHKK, m_BHKK),
            _einsum("bhij,bhjv->bhiv", mn_BHKK, b_BHKV) + bn_BHKV), None

  # zeros_like: under shard_map the carries vary over the mesh axes as the inputs do.
  init = (eye_KK + jnp.zeros_like(m_BNHKK[:, 0]), jnp.zeros_like(b_BNHKV[:, 0]))
  (m_BHKK, b_BHKV), _ = lax.scan(
      step, init, (jnp.moveaxis(m_BNHKK, 1, 0), jnp.moveaxis(b_BNHKV, 1, 0)))
  return m_BHKK, b_BHKV


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
    new_BHKV = _einsum("bhij,bhjv->bhiv", m_BHKK, state_BHKV) + b_BHKV
    return new_BHKV * keep_B[:, None, None, None], state_BHKV

  # keep of the next shard; the state after the last shard (unused) is never reset.
  keeps_next_PB = jnp.concatenate([keeps_PB[1:], jnp.ones_like(keeps_PB[:1])]).astype(jnp.float32)
  _, states_PBHKV = lax.scan(step, state_BHKV.astype(jnp.float32), (ms, bs, keeps_next_PB))
  return states_PBHKV
