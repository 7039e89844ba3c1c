"""The gated delta rule's kernel path (`gated_delta_rule(state_kernel="pallas")`): `kernel_chunked_forward`, the
chunked form (`gated_delta`'s docstring) as XLA's batched matmuls over (row, chunk, head), q and k at their key
heads, differentiated by autodiff, around two Pallas (Triton) kernels for what batched matmuls cannot do, each with
its own VJP:

- `unit_lower_inverse`: T = (I + A)⁻¹ of each chunk's strictly lower A [C, C], one program per matrix. The diagonal
  blocks of 16 by forward substitution, the blocks below them by T_ij = −T_ii Σ_{j≤m<i} A_im T_mj (exact block
  inversion: no powers of A, whose entries a Neumann series would let grow). Backward: dA = −Tᵀ dT Tᵀ.
- `state_pass`: the loop over chunks carrying the state S [K, V], one program per (row, value head, block of V)
  keeping its slice of S on chip:

    forward, chunk n:  S_n = S (stored),  V_new = U − W S,  S ← d S + Kdᵀ V_new
    backward, n from the last chunk down, carrying dS (the gradient of the state leaving chunk n):
      dS_n' = dS (stored),  dV_new = ∂V_new + Kd dS,  dS ← d dS + ∂S_n − Wᵀ dV_new

  with ∂ the cotangents that reach S_n and V_new from the output (O = Qd S_n + P V_new, computed by XLA). The
  gradients of Kd, W and d contract over V, so XLA forms them from the stored S_n, dS_n', V_new and dV_new.

Operands are bfloat16 unless the inputs are float32 (then float32 at HIGHEST precision); the state, its gradient
and the decays are float32 inside. In a program lowered for anything but CUDA the kernels run in Pallas' interpreter
(the tests' path).

Shape letters: see relaymoe_jax (the gated delta rule's own).
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from models.attention import gated_delta_chunks as gdc

BLOCK = 16  # the inverse's diagonal blocks: the smallest a tensor-core dot takes
BLOCK_V = 64  # V columns per state-pass program: S's slice [K, 64] in float32 stays in registers (fla's choice too)
MIN_PROGRAMS = 256  # about two per SM of an H200 (132): a long row with few heads splits V finer to fill them


def _precision(dtype):
  return lax.Precision.HIGHEST if dtype == jnp.float32 else None


def _dot(a, b, dtype, trans_a=False, trans_b=False):
  """a @ b (either transposed) on `dtype` operands with float32 accumulation."""
  a = a.T if trans_a else a
  b = b.T if trans_b else b
  return jnp.dot(a.astype(dtype), b.astype(dtype), precision=_precision(dtype), preferred_element_type=jnp.float32)


def operand_einsum(spec, a, b, dtype):
  """`jnp.einsum` on `dtype` operands with float32 accumulation (HIGHEST precision when float32). XLA:CPU cannot run
  some bfloat16 dots with a float32 result ("Unsupported element type for DotThunk"): there the rounded operands
  are multiplied as float32, the same products and sums."""
  a, b = a.astype(dtype), b.astype(dtype)
  on = lambda dtype: lambda a, b: jnp.einsum(spec, a.astype(dtype), b.astype(dtype), precision=_precision(dtype),
                                             preferred_element_type=jnp.float32)
  return lax.platform_dependent(a, b, cpu=on(jnp.float32), default=on(dtype))


def _per_platform(call, *args):
  """`call(*args, interpret)`: the kernels compiled by Triton where the program is lowered for CUDA (whatever machine
  lowers it: compile-only planning too), in Pallas' interpreter elsewhere."""
  return lax.platform_dependent(*args, cuda=lambda *a: call(*a, False), default=lambda *a: call(*a, True))


def _call(kernel, grid, in_specs, out_specs, out_shape, interpret, name, num_warps=4):
  return pl.pallas_call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
                        interpret=interpret, name=name,
                        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1))


def _diagonal_inverse(l_ss, rows_ss, eye_ss):
  """(I + L)⁻¹ of a strictly lower [16, 16] block by forward substitution: row i of T is e_i − Σ_j L_ij T_j (rows
  below i are still e_j, and L_ij = 0 there)."""
  t_ss = eye_ss
  for i in range(1, l_ss.shape[0]):
    l_i = jnp.sum(jnp.where(rows_ss == i, l_ss, 0.0), axis=0)
    t_ss = t_ss - jnp.where(rows_ss == i, jnp.sum(l_i[:, None] * t_ss, axis=0)[None, :], 0.0)
  return t_ss


def _inverse_kernel(a_ref, t_ref):
  blocks = a_ref.shape[-1] // BLOCK
  rows_ss = lax.broadcasted_iota(jnp.int32, (BLOCK, BLOCK), 0)
  cols_ss = lax.broadcasted_iota(jnp.int32, (BLOCK, BLOCK), 1)
  eye_ss = (rows_ss == cols_ss).astype(jnp.float32)
  a = lambda i, j: a_ref[pl.ds(i * BLOCK, BLOCK), pl.ds(j * BLOCK, BLOCK)].astype(jnp.float32)
  t = {(i, i): _diagonal_inverse(jnp.where(rows_ss > cols_ss, a(i, i), 0.0), rows_ss, eye_ss)
       for i in range(blocks)}
  for i in range(1, blocks):
    for j in range(i - 1, -1, -1):
      below = sum(_dot(a(i, m), t[m, j], jnp.float32) for m in range(j, i))
      t[i, j] = -_dot(t[i, i], below, jnp.float32)
  for i in range(blocks):
    for j in range(blocks):
      t_ref[pl.ds(i * BLOCK, BLOCK), pl.ds(j * BLOCK, BLOCK)] = t.get((i, j), jnp.zeros_like(eye_ss))


def _inverse(a_MCC, interpret):
  m, c, _ = a_MCC.shape
  spec = pl.BlockSpec((pl.squeezed, c, c), lambda i: (i, 0, 0))
  return _call(_inverse_kernel, (m,), [spec], spec, jax.ShapeDtypeStruct(a_MCC.shape, jnp.float32), interpret,
               "gated_delta_unit_lower_inverse")(a_MCC)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def unit_lower_inverse(a_XCC, dtype, interpret):
  """(I + tril(A, −1))⁻¹ [..., C, C] float32, C a multiple of 16; `dtype` the backward's matmul operands."""
  return _inverse(a_XCC.reshape(-1, *a_XCC.shape[-2:]), interpret).reshape(a_XCC.shape)


def _unit_lower_inverse_fwd(a_XCC, dtype, interpret):
  t_XCC = unit_lower_inverse(a_XCC, dtype, interpret)
  return t_XCC, t_XCC


def _unit_lower_inverse_bwd(dtype, interpret, t_XCC, dt_XCC):
  mm = functools.partial(operand_einsum, dtype=dtype)
  da_XCC = -mm("...rt,...ut->...ru", mm("...sr,...st->...rt", t_XCC, dt_XCC), t_XCC)  # −Tᵀ dT Tᵀ
  return (jnp.tril(da_XCC, -1),)


unit_lower_inverse.defvjp(_unit_lower_inverse_fwd, _unit_lower_inverse_bwd)


def _state_forward_kernel(kd_ref, w_ref, u_ref, decay_ref, state_ref, states_ref, vnew_ref, final_ref, *,
                          num_chunks, dtype):
  def chunk(n, s_KJ):
    states_ref[n] = s_KJ.astype(states_ref.dtype)
    vnew_CJ = u_ref[n].astype(jnp.float32) - _dot(w_ref[n], s_KJ, dtype)
    vnew_ref[n] = vnew_CJ.astype(vnew_ref.dtype)
    return decay_ref[pl.ds(n, 1)] * s_KJ + _dot(kd_ref[n], vnew_CJ, dtype, trans_a=True)

  final_ref[...] = lax.fori_loop(0, num_chunks, chunk, state_ref[...])


def _state_backward_kernel(kd_ref, w_ref, decay_ref, dstates_ref, dvnew_in_ref, dfinal_ref,
                           dcarry_ref, dvnew_ref, dstate_ref, *, num_chunks, dtype):
  def chunk(i, ds_KJ):
    n = num_chunks - 1 - i
    dcarry_ref[n] = ds_KJ.astype(dcarry_ref.dtype)
    dvnew_CJ = dvnew_in_ref[n].astype(jnp.float32) + _dot(kd_ref[n], ds_KJ, dtype)
    dvnew_ref[n] = dvnew_CJ.astype(dvnew_ref.dtype)
    return (decay_ref[pl.ds(n, 1)] * ds_KJ + dstates_ref[n].astype(jnp.float32)
            - _dot(w_ref[n], dvnew_CJ, dtype, trans_a=True))

  dstate_ref[...] = lax.fori_loop(0, num_chunks, chunk, dfinal_ref[...].astype(jnp.float32))


def block_v(b, h, v):
  """V columns per state-pass program: BLOCK_V, halved (down to 16) while the grid has under MIN_PROGRAMS."""
  block = min(BLOCK_V, v)
  while b * h * (v // block) < MIN_PROGRAMS and block > 16 and v % (block // 2) == 0:
    block //= 2
  return block


def _specs(n, c, k, block):
  """BlockSpecs over the grid (row, head, block of V) of whole-sequence slices: [B, N, C, H, ·] chunk tensors by
  key columns or by V block, [B, N, H, K, V] per-chunk states, [B, H, N] decays, [B, H, K, V] states."""
  sq = pl.squeezed
  return dict(
      chunk_k=pl.BlockSpec((sq, n, c, sq, k), lambda bi, hi, ji: (bi, 0, 0, hi, 0)),
      chunk_v=pl.BlockSpec((sq, n, c, sq, block), lambda bi, hi, ji: (bi, 0, 0, hi, ji)),
      states=pl.BlockSpec((sq, n, sq, k, block), lambda bi, hi, ji: (bi, 0, hi, 0, ji)),
      decay=pl.BlockSpec((sq, sq, n), lambda bi, hi, ji: (bi, hi, 0)),
      state=pl.BlockSpec((sq, sq, k, block), lambda bi, hi, ji: (bi, hi, 0, ji)))


def _grid_and_specs(kd, u):
  b, n, c, h, k = kd.shape
  v = u.shape[-1]
  block = block_v(b, h, v)
  return (b, h, v // block), _specs(n, c, k, block)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def state_pass(kd, w, u, decay, state, dtype, interpret):
  """The loop over chunks: (S_n [B, N, H, K, V] the state entering each chunk, in `dtype`; V_new [B, N, C, H, V] in
  `dtype`; the final state [B, H, K, V] float32), from Kd, W [B, N, C, H, K] and U [B, N, C, H, V] in `dtype`, the
  decays [B, H, N] and the initial state [B, H, K, V], float32."""
  b, n, c, h, k = kd.shape
  v = u.shape[-1]
  grid, spec = _grid_and_specs(kd, u)
  out_shape = [jax.ShapeDtypeStruct((b, n, h, k, v), dtype), jax.ShapeDtypeStruct(u.shape, dtype),
               jax.ShapeDtypeStruct(state.shape, jnp.float32)]
  kernel = functools.partial(_state_forward_kernel, num_chunks=n, dtype=dtype)
  return _call(kernel, grid, [spec["chunk_k"], spec["chunk_k"], spec["chunk_v"], spec["decay"], spec["state"]],
               [spec["states"], spec["chunk_v"], spec["state"]], out_shape, interpret,
               "gated_delta_state_forward")(kd, w, u, decay, state)


def _state_pass_fwd(kd, w, u, decay, state, dtype, interpret):
  states, vnew, final = state_pass(kd, w, u, decay, state, dtype, interpret)
  return (states, vnew, final), (kd, w, decay, states, vnew)


def _state_pass_bwd(dtype, interpret, residuals, cotangents):
  kd, w, decay, states, vnew = residuals
  dstates, dvnew_in, dfinal = cotangents
  n = kd.shape[1]
  grid, spec = _grid_and_specs(kd, vnew)
  out_shape = [jax.ShapeDtypeStruct(states.shape, dtype), jax.ShapeDtypeStruct(vnew.shape, dtype),
               jax.ShapeDtypeStruct(dfinal.shape, jnp.float32)]
  kernel = functools.partial(_state_backward_kernel, num_chunks=n, dtype=dtype)
  dcarry, dvnew, dstate = _call(
      kernel, grid, [spec["chunk_k"], spec["chunk_k"], spec["decay"], spec["states"], spec["chunk_v"],
                     spec["state"]], [spec["states"], spec["chunk_v"], spec["state"]], out_shape, interpret,
      "gated_delta_state_backward")(kd, w, decay, dstates, dvnew_in, dfinal)
  mm = functools.partial(operand_einsum, dtype=dtype)
  dkd = mm("bnchv,bnhkv->bnchk", vnew, dcarry)
  dw = -mm("bnchv,bnhkv->bnchk", dvnew, states)
  ddecay = jnp.moveaxis(jnp.sum(states.astype(jnp.float32) * dcarry.astype(jnp.float32), axis=(-2, -1)), 1, 2)
  return dkd.astype(kd.dtype), dw.astype(w.dtype), dvnew, ddecay, dstate


state_pass.defvjp(_state_pass_fwd, _state_pass_bwd)


class _HeadChunks(NamedTuple):
  """The kernel path's inputs in chunks: q and k at their key heads (value head h = key head g, repeat r)."""
  q_BNCGK: jax.Array  # normalised, in the operand dtype
  k_BNCGK: jax.Array
  v_BNCGRV: jax.Array
  gamma_BNCGR: jax.Array  # Γ, the chunk's cumulative log decay, float32
  beta_BNCGR: jax.Array


def _head_chunks(q, k, v, g, beta, chunk_size, l2_normalize, dtype):
  b, _, hk, _ = k.shape
  hv, dv = v.shape[2:]
  q_BSGK, k_BSGK = gdc.normalize_qk(q, k, hv, l2_normalize)
  q_BNCGK, k_BNCGK = (gdc.to_chunks(x, chunk_size).astype(dtype) for x in (q_BSGK, k_BSGK))
  n = q_BNCGK.shape[1]
  by_key_head = lambda x_BSH: gdc.to_chunks(x_BSH.astype(jnp.float32), chunk_size).reshape(b, n, chunk_size, hk, -1)
  return _HeadChunks(q_BNCGK, k_BNCGK, gdc.to_chunks(v, chunk_size).reshape(b, n, chunk_size, hk, hv // hk, dv),
                     jnp.cumsum(by_key_head(g), axis=2), by_key_head(beta))


def _per_position(x_BNC):
  return x_BNC[..., None, None]  # [B, N, C, 1, 1] against [B, N, C, G, R]


def _scaled(x_BNCGK, scale_BNCGR, dtype):
  return (x_BNCGK[:, :, :, :, None] * scale_BNCGR[..., None]).astype(dtype)


def _wy(x, masks, decay_BNGRCC, dtype):
  """(U, W) [B, N, C, G, R, ·] in `dtype`: (I + A)⁻¹ times βV and times the decayed K, the inverse a kernel."""
  mm = functools.partial(operand_einsum, dtype=dtype)
  kk_BNG1CC = mm("bncgk,bnsgk->bngcs", x.k_BNCGK, x.k_BNCGK)[:, :, :, None]
  a_BNGRCC = kk_BNG1CC * jnp.moveaxis(x.beta_BNCGR, 2, -1)[..., None] * decay_BNGRCC
  chunk_size = a_BNGRCC.shape[-1]
  t_BNGRCC = (_per_platform(lambda a, interpret: unit_lower_inverse(a, dtype, interpret), a_BNGRCC)
              if chunk_size % BLOCK == 0 else gdc.unit_lower_inverse(a_BNGRCC))
  xw_BNCGRK = _scaled(x.k_BNCGK, x.beta_BNCGR * _per_position(masks.reads_BNC) * jnp.exp(x.gamma_BNCGR), dtype)
  return (mm("bngrcs,bnsgrv->bncgrv", t_BNGRCC, x.v_BNCGRV * x.beta_BNCGR[..., None]).astype(dtype),
          mm("bngrcs,bnsgrk->bncgrk", t_BNGRCC, xw_BNCGRK).astype(dtype))


def kernel_chunked_forward(q, k, v, g, beta, seg_BS, state_BHKV, chunk_size, l2_normalize):
  """The chunked form with the Pallas kernels (`gated_delta_kernels`): the inverses and the loop over chunks as
  kernels, the rest XLA's batched matmuls over (row, chunk, head), q and k at their key heads; operands bfloat16
  unless v is float32. Returns (o [B, S, H, V] in v's dtype, final state)."""
  dtype = jnp.float32 if v.dtype == jnp.float32 else jnp.bfloat16
  x = _head_chunks(q, k, v, g, beta, chunk_size, l2_normalize, dtype)
  masks = gdc.chunk_masks(seg_BS, chunk_size)
  b, n, c, hk, r, dv = x.v_BNCGRV.shape
  decay_BNGRCC = gdc.decays(jnp.moveaxis(x.gamma_BNCGR, 2, -1), masks.sees_BNCC[:, :, None, None])
  u_BNCGRV, w_BNCGRK = _wy(x, masks, decay_BNGRCC, dtype)
  gamma_end_BNGR = x.gamma_BNCGR[:, :, -1]
  kd_BNCGRK = _scaled(x.k_BNCGK, _per_position(masks.writes_BNC) * jnp.exp(gamma_end_BNGR[:, :, None]
                                                                           - x.gamma_BNCGR), dtype)
  decay_BHN = jnp.moveaxis((masks.keeps_BN[..., None, None] * jnp.exp(gamma_end_BNGR)).reshape(b, n, -1), 1, 2)
  heads = lambda x_BNCGR_: x_BNCGR_.reshape(b, n, c, hk * r, -1)
  states_BNHKV, vnew_BNCHV, state_BHKV = _per_platform(
      lambda *a: state_pass(*a[:-1], dtype, a[-1]), heads(kd_BNCGRK), heads(w_BNCGRK), heads(u_BNCGRV), decay_BHN,
      state_BHKV)

  mm = functools.partial(operand_einsum, dtype=dtype)
  qd_BNCGRK = _scaled(x.q_BNCGK, _per_position(masks.reads_BNC) * jnp.exp(x.gamma_BNCGR), dtype)
  p_BNGRCC = mm("bncgk,bnsgk->bngcs", x.q_BNCGK, x.k_BNCGK)[:, :, :, None] * decay_BNGRCC
  o_BNCGRV = (mm("bncgrk,bngrkv->bncgrv", qd_BNCGRK, states_BNHKV.reshape(b, n, hk, r, *states_BNHKV.shape[-2:]))
              + mm("bngrcs,bnsgrv->bncgrv", p_BNGRCC, vnew_BNCHV.reshape(b, n, c, hk, r, dv)))
  return o_BNCGRV.reshape(b, n * c, hk * r, dv)[:, :v.shape[1]].astype(v.dtype), state_BHKV
