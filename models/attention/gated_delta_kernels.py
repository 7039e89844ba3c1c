"""The gated delta rule's kernel path (`gated_delta_rule(state_kernel="pallas")`): `kernel_chunked_forward`, the
chunked form (`gated_delta`'s docstring) as XLA's batched matmuls over (row, head, chunk) in head-major layout
([B, H, N, C, ·], so that no matmul's operands or result need moving), q and k at their key heads, differentiated
by autodiff, around two Pallas (Triton) kernels for what batched matmuls cannot do, each with
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
      t_ref[pl.ds(i * BLOCK, BLOCK), pl.ds(j * BLOCK, BLOCK)] = t.get((i, j), jnp.zeros_like(eye_ss)).astype(
          t_ref.dtype)


def _inverse(a_MCC, dtype, interpret):
  m, c, _ = a_MCC.shape
  spec = pl.BlockSpec((pl.squeezed, c, c), lambda i: (i, 0, 0))
  return _call(_inverse_kernel, (m,), [spec], spec, jax.ShapeDtypeStruct(a_MCC.shape, dtype), interpret,
               "gated_delta_unit_lower_inverse")(a_MCC)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def unit_lower_inverse(a_XCC, dtype, interpret):
  """(I + tril(A, −1))⁻¹ [..., C, C] of float32 A, C a multiple of 16, computed in float32 and stored in `dtype`,
  the matmul operand type of everything that reads it (its backward too)."""
  return _inverse(a_XCC.reshape(-1, *a_XCC.shape[-2:]), dtype, interpret).reshape(a_XCC.shape)


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
  """BlockSpecs over the grid (row, head, block of V) of whole-sequence slices: [B, H, N, C, ·] chunk tensors by
  key columns or by V block, [B, H, N, K, V] per-chunk states, [B, H, N] decays, [B, H, K, V] states."""
  sq = pl.squeezed
  return dict(
      chunk_k=pl.BlockSpec((sq, sq, n, c, k), lambda bi, hi, ji: (bi, hi, 0, 0, 0)),
      chunk_v=pl.BlockSpec((sq, sq, n, c, block), lambda bi, hi, ji: (bi, hi, 0, 0, ji)),
      states=pl.BlockSpec((sq, sq, n, k, block), lambda bi, hi, ji: (bi, hi, 0, 0, ji)),
      decay=pl.BlockSpec((sq, sq, n), lambda bi, hi, ji: (bi, hi, 0)),
      state=pl.BlockSpec((sq, sq, k, block), lambda bi, hi, ji: (bi, hi, 0, ji)))


def _grid_and_specs(kd, u):
  b, h, n, c, k = kd.shape
  v = u.shape[-1]
  block = block_v(b, h, v)
  return (b, h, v // block), _specs(n, c, k, block)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def state_pass(kd, w, u, decay, state, dtype, interpret):
  """The loop over chunks: (S_n [B, H, N, K, V] the state entering each chunk, in `dtype`; V_new [B, H, N, C, V] in
  `dtype`; the final state [B, H, K, V] float32), from Kd, W [B, H, N, C, K] and U [B, H, N, C, V] in `dtype`, the
  decays [B, H, N] and the initial state [B, H, K, V], float32."""
  b, h, n, c, k = kd.shape
  v = u.shape[-1]
  grid, spec = _grid_and_specs(kd, u)
  out_shape = [jax.ShapeDtypeStruct((b, h, n, k, v), dtype), jax.ShapeDtypeStruct(u.shape, dtype),
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
  n = kd.shape[2]
  grid, spec = _grid_and_specs(kd, vnew)
  out_shape = [jax.ShapeDtypeStruct(states.shape, dtype), jax.ShapeDtypeStruct(vnew.shape, dtype),
               jax.ShapeDtypeStruct(dfinal.shape, jnp.float32)]
  kernel = functools.partial(_state_backward_kernel, num_chunks=n, dtype=dtype)
  dcarry, dvnew, dstate = _call(
      kernel, grid, [spec["chunk_k"], spec["chunk_k"], spec["decay"], spec["states"], spec["chunk_v"],
                     spec["state"]], [spec["states"], spec["chunk_v"], spec["state"]], out_shape, interpret,
      "gated_delta_state_backward")(kd, w, decay, dstates, dvnew_in, dfinal)
  mm = functools.partial(operand_einsum, dtype=dtype)
  dkd = mm("bhncv,bhnkv->bhnck", vnew, dcarry)
  dw = -mm("bhncv,bhnkv->bhnck", dvnew, states)
  ddecay = jnp.sum(states.astype(jnp.float32) * dcarry.astype(jnp.float32), axis=(-2, -1))
  return dkd.astype(kd.dtype), dw.astype(w.dtype), dvnew, ddecay, dstate


state_pass.defvjp(_state_pass_fwd, _state_pass_bwd)


class _HeadChunks(NamedTuple):
  """The kernel path's inputs in chunks, head-major ([B, H, N, C, ·]: every matmul's batch dimensions lead, so XLA
  moves no operand), q and k at their key heads (value head h = key head g, repeat r)."""
  q_BGNCK: jax.Array  # normalised, in the operand dtype
  k_BGNCK: jax.Array
  v_BGRNCV: jax.Array
  gamma_BGRNC: jax.Array  # Γ, the chunk's cumulative log decay, float32
  beta_BGRNC: jax.Array


def _head_major(x_BS_, chunk_size):
  """[B, S, H, ...] → [B, H, N, C, ...] (one transpose), right-padding S to a multiple of C."""
  x_BHS_ = jnp.moveaxis(x_BS_, 2, 1)
  pad = -x_BHS_.shape[2] % chunk_size
  x_BHS_ = jnp.pad(x_BHS_, [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * (x_BHS_.ndim - 3))
  return x_BHS_.reshape(*x_BHS_.shape[:2], -1, chunk_size, *x_BHS_.shape[3:])


def _head_chunks(q, k, v, g, beta, chunk_size, l2_normalize, dtype):
  b, _, hk, _ = k.shape
  hv, dv = v.shape[2:]
  q_BSGK, k_BSGK = gdc.normalize_qk(q, k, hv, l2_normalize)
  q_BGNCK, k_BGNCK = (_head_major(x.astype(dtype), chunk_size) for x in (q_BSGK, k_BSGK))
  n = q_BGNCK.shape[2]
  by_key_head = lambda x_BSH: _head_major(x_BSH.astype(jnp.float32), chunk_size).reshape(b, hk, -1, n, chunk_size)
  return _HeadChunks(q_BGNCK, k_BGNCK, _head_major(v, chunk_size).reshape(b, hk, hv // hk, n, chunk_size, dv),
                     jnp.cumsum(by_key_head(g), axis=-1), by_key_head(beta))


def _per_position(x_BNC):
  return x_BNC[:, None, None]  # [B, 1, 1, N, C] against [B, G, R, N, C]


def _scaled(x_BGNCK, scale_BGRNC, dtype):
  return (x_BGNCK[:, :, None] * scale_BGRNC[..., None]).astype(dtype)


def _wy(x, masks, decay_BGRNCC, dtype):
  """(U, W) [B, G, R, N, C, ·] in `dtype`: (I + A)⁻¹ times βV and times the decayed K, the inverse a kernel."""
  mm = functools.partial(operand_einsum, dtype=dtype)
  kk_BG1NCC = mm("bgnck,bgnsk->bgncs", x.k_BGNCK, x.k_BGNCK)[:, :, None]
  a_BGRNCC = kk_BG1NCC * x.beta_BGRNC[..., None] * decay_BGRNCC
  chunk_size = a_BGRNCC.shape[-1]
  t_BGRNCC = (_per_platform(lambda a, interpret: unit_lower_inverse(a, dtype, interpret), a_BGRNCC)
              if chunk_size % BLOCK == 0 else gdc.unit_lower_inverse(a_BGRNCC))
  xw_BGRNCK = _scaled(x.k_BGNCK, x.beta_BGRNC * _per_position(masks.reads_BNC) * jnp.exp(x.gamma_BGRNC), dtype)
  return (mm("bgrncs,bgrnsv->bgrncv", t_BGRNCC, x.v_BGRNCV * x.beta_BGRNC[..., None]).astype(dtype),
          mm("bgrncs,bgrnsk->bgrnck", t_BGRNCC, xw_BGRNCK).astype(dtype))


def kernel_chunked_forward(q, k, v, g, beta, seg_BS, state_BHKV, chunk_size, l2_normalize):
  """The chunked form with the Pallas kernels (`gated_delta_kernels`): the inverses and the loop over chunks as
  kernels, the rest XLA's batched matmuls over (row, head, chunk), q and k at their key heads; operands bfloat16
  unless v is float32. Returns (o [B, S, H, V] in v's dtype, final state)."""
  dtype = jnp.float32 if v.dtype == jnp.float32 else jnp.bfloat16
  x = _head_chunks(q, k, v, g, beta, chunk_size, l2_normalize, dtype)
  masks = gdc.chunk_masks(seg_BS, chunk_size)
  b, hk, r, n, c, dv = x.v_BGRNCV.shape
  decay_BGRNCC = gdc.decays(x.gamma_BGRNC, masks.sees_BNCC[:, None, None])
  u_BGRNCV, w_BGRNCK = _wy(x, masks, decay_BGRNCC, dtype)
  gamma_end_BGRN = x.gamma_BGRNC[..., -1]
  kd_BGRNCK = _scaled(x.k_BGNCK, _per_position(masks.writes_BNC) * jnp.exp(gamma_end_BGRN[..., None]
                                                                           - x.gamma_BGRNC), dtype)
  decay_BHN = (masks.keeps_BN[:, None, None] * jnp.exp(gamma_end_BGRN)).reshape(b, hk * r, n)
  heads = lambda x_BGR_: x_BGR_.reshape(b, hk * r, *x_BGR_.shape[3:])
  states_BHNKV, vnew_BHNCV, state_BHKV = _per_platform(
      lambda *a: state_pass(*a[:-1], dtype, a[-1]), heads(kd_BGRNCK), heads(w_BGRNCK), heads(u_BGRNCV), decay_BHN,
      state_BHKV)

  mm = functools.partial(operand_einsum, dtype=dtype)
  groups = lambda x_BH_: x_BH_.reshape(b, hk, r, *x_BH_.shape[2:])
  qd_BGRNCK = _scaled(x.q_BGNCK, _per_position(masks.reads_BNC) * jnp.exp(x.gamma_BGRNC), dtype)
  p_BGRNCC = mm("bgnck,bgnsk->bgncs", x.q_BGNCK, x.k_BGNCK)[:, :, None] * decay_BGRNCC
  o_BGRNCV = (mm("bgrnck,bgrnkv->bgrncv", qd_BGRNCK, groups(states_BHNKV))
              + mm("bgrncs,bgrnsv->bgrncv", p_BGRNCC, groups(vnew_BHNCV)))
  o_BSHV = jnp.moveaxis(o_BGRNCV.reshape(b, hk * r, n * c, dv), 1, 2)
  return o_BSHV[:, :v.shape[1]].astype(v.dtype), state_BHKV
