"""The gated delta rule's backward in Pallas (Triton) kernels, on the chunked form (`gated_delta`'s docstring) in
head-major layout, q and k at their key heads; `gated_delta_kernel_path` runs them after rerunning the forward's
state pass. With S_n the state entering chunk n, V_new its new values and dS' the gradient of the state leaving it:

- `output_backward`, from dO: of O = Qd S_n + P V_new (Qd = Q ⊙ m exp(Γ), P = (Q Kᵀ) ⊙ D) the cotangent
  ∂V_new = Pᵀ dO that the state pass's backward takes, and dQ, dK, dΓ:
    dQd = dO S_nᵀ,  dP = dO V_newᵀ,  dQ = dQd ⊙ m exp(Γ) + (dP ⊙ D) K,  dK = (dP ⊙ D)ᵀ Q,
    dΓ_r = Σ_k dQd ⊙ Qd + Σ_s (dP ⊙ P)_rs − Σ_s (dP ⊙ P)_sr.
- `state_backward`: the loop over chunks from the last down (`gated_delta_kernels`' docstring), forming S_n's
  cotangent ∂S_n = Qdᵀ dO in the loop (fla's choice: it never reaches memory).
- `wy_backward`, from the state pass's dS' and dV_new and the forward's T = (I + A)⁻¹: of V_new = U − W S_n,
  S_{n+1} = d S_n + Kdᵀ V_new, U = T βV, W = T Xw (Xw = K ⊙ β m exp(Γ)), Kd = K ⊙ e exp(Γ_C − Γ),
  A = strictly lower (diag(β) K Kᵀ) ⊙ D:
    dW = −dV_new S_nᵀ,  dKd = V_new dS'ᵀ,  dd = Σ S_n ⊙ dS',  dT = dV_new (βV)ᵀ + dW Xwᵀ,
    dV = β ⊙ Tᵀ dV_new,  dXw = Tᵀ dW,  dA = −Tᵀ dT Tᵀ,
  then through Xw, Kd, d and A to dK, dβ and dΓ.

Each program takes one (row, key head, chunk) and its value heads in turn, so dQ and dK sum over them on chip and
leave in float32 at the key heads; the other gradients are per value head, float32 (dV in v's dtype). Key and value
columns go in blocks of BLOCK_V (loops in the program). Each takes `interpret` as the forward kernels do.

Shape letters: see relaymoe_jax (the gated delta rule's own).
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from models.attention.gated_delta_kernels import (BLOCK_V, STATE_STAGES, block_v, call, decay, dot, sees_in_chunk,
                                                  state_specs)


def _column_blocks(width):
  """Slices of a [·, width] tile in blocks of BLOCK_V columns (fla's backward tiles): the backward's programs hold
  [C, BLOCK_V] float32 accumulators, not [C, K] ones that would spill their registers. The tests' K = V = 2 BLOCK_V
  run every such loop twice."""
  block = math.gcd(width, BLOCK_V)
  return [pl.ds(i * block, block) for i in range(width // block)]


def _block(j, width):
  """The j-th block of `width` columns, j traced (a `fori_loop`'s index)."""
  return pl.ds(pl.multiple_of(j * width, width), width)


def _output_backward_kernel(q_ref, k_ref, gamma_ref, reads_ref, seg_ref, states_ref, vnew_ref, do_ref,
                            dq_ref, dk_ref, dgamma_ref, dvnew_ref, *, dtype):
  """One (row, key head, chunk): q_ref, k_ref [C, K]; per value head r: gamma_ref [R, C], states_ref [R, K, V],
  vnew_ref [R, C, V], do_ref [C, R, V] (the output's layout); outputs dq_ref, dk_ref [C, K], dgamma_ref [R, C],
  dvnew_ref [R, C, V]."""
  keys, values = _column_blocks(q_ref.shape[1]), _column_blocks(vnew_ref.shape[-1])
  qk_CC = sum(dot(q_ref[:, kc], k_ref[:, kc], dtype, trans_b=True) for kc in keys)
  sees_CC = sees_in_chunk(seg_ref[...])
  dq = [jnp.zeros((qk_CC.shape[0], kc.size), jnp.float32) for kc in keys]
  dk = list(dq)
  for r in range(gamma_ref.shape[0]):
    gamma_C = gamma_ref[r]
    scale_C = reads_ref[...] * jnp.exp(gamma_C)
    d_CC = decay(gamma_C, gamma_C, sees_CC)
    p_CC = qk_CC * d_CC
    dp_CC = jnp.zeros(qk_CC.shape, jnp.float32)
    for vc in values:
      do_CJ = do_ref[:, r, vc]
      dp_CC += dot(do_CJ, vnew_ref[r, :, vc], dtype, trans_b=True)
      dvnew_ref[r, :, vc] = dot(p_CC, do_CJ, dtype, trans_a=True).astype(dvnew_ref.dtype)
    ds_CC = dp_CC * d_CC
    g_CC = dp_CC * p_CC
    dgamma_C = jnp.sum(g_CC, axis=1) - jnp.sum(g_CC, axis=0)
    for i, kc in enumerate(keys):
      q_CJ = q_ref[:, kc]
      dqd_CJ = sum(dot(do_ref[:, r, vc], states_ref[r, kc, vc], dtype, trans_b=True) for vc in values)
      dq[i] += dqd_CJ * scale_C[:, None] + dot(ds_CC, k_ref[:, kc], dtype)
      dk[i] += dot(ds_CC, q_CJ, dtype, trans_a=True)
      dgamma_C += jnp.sum(dqd_CJ * q_CJ.astype(jnp.float32), axis=1) * scale_C
    dgamma_ref[r] = dgamma_C
  for i, kc in enumerate(keys):
    dq_ref[:, kc] = dq[i]
    dk_ref[:, kc] = dk[i]


def _by_key_head(b, hk, r, n, c):
  """BlockSpec makers over the grid (row, key head, chunk)."""
  sq = pl.squeezed
  key = lambda *tail: pl.BlockSpec((sq, sq, sq) + tail, lambda bi, gi, ni: (bi, gi, ni) + (0,) * len(tail))
  value = lambda *tail: pl.BlockSpec((sq, r, sq) + tail, lambda bi, gi, ni: (bi, gi, ni) + (0,) * len(tail))
  position = pl.BlockSpec((sq, sq, c), lambda bi, gi, ni: (bi, ni, 0))
  return key, value, position


def output_backward(q_BGNCK, k_BGNCK, gamma_BHNC, reads_BNC, seg_BNC, states_BHNKV, vnew_BHNCV, do_BSHV, dtype,
                    interpret):
  """(dQ, dK [B, G, N, C, K], dΓ [B, H, N, C], float32; ∂V_new [B, H, N, C, V] in `dtype`) of the forward's
  `chunk_output` from dO [B, N·C, H, V] (∂S_n: `state_backward` forms it in its loop)."""
  b, hk, n, c, k = q_BGNCK.shape
  h, v = vnew_BHNCV.shape[1], vnew_BHNCV.shape[-1]
  r = h // hk
  key, value, position = _by_key_head(b, hk, r, n, c)
  sq = pl.squeezed
  do_spec = pl.BlockSpec((sq, c, r, v), lambda bi, gi, ni: (bi, ni, gi, 0))
  f32 = lambda shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  out_shape = [f32(q_BGNCK.shape), f32(k_BGNCK.shape), f32(gamma_BHNC.shape),
               jax.ShapeDtypeStruct(vnew_BHNCV.shape, dtype)]
  return call(functools.partial(_output_backward_kernel, dtype=dtype), (b, hk, n),
              [key(c, k), key(c, k), value(c), position, position, value(k, v), value(c, v), do_spec],
              [key(c, k), key(c, k), value(c), value(c, v)], out_shape, interpret,
              "gated_delta_output_backward")(
                  q_BGNCK, k_BGNCK, gamma_BHNC, reads_BNC, seg_BNC, states_BHNKV, vnew_BHNCV, do_BSHV)


def _state_backward_kernel(kd_ref, w_ref, q_ref, gamma_ref, reads_ref, decay_ref, do_ref, dvnew_in_ref, dfinal_ref,
                           dcarry_ref, dvnew_ref, dstate_ref, *, num_chunks, dtype):
  c = q_ref.shape[1]

  def chunk(i, ds_KJ):
    n = num_chunks - 1 - i
    dcarry_ref[n] = ds_KJ.astype(dcarry_ref.dtype)
    dvnew_CJ = dvnew_in_ref[n].astype(jnp.float32) + dot(kd_ref[n], ds_KJ, dtype)
    dvnew_ref[n] = dvnew_CJ.astype(dvnew_ref.dtype)
    qd_CK = q_ref[n].astype(jnp.float32) * (reads_ref[n] * jnp.exp(gamma_ref[n]))[:, None]
    return (decay_ref[pl.ds(n, 1)] * ds_KJ + dot(qd_CK, do_ref[pl.ds(n * c, c)], dtype, trans_a=True)
            - dot(w_ref[n], dvnew_CJ, dtype, trans_a=True))

  dstate_ref[...] = lax.fori_loop(0, num_chunks, chunk, dfinal_ref[...].astype(jnp.float32))


def state_backward(kd, w, q_BGNCK, gamma_BHNC, reads_BNC, decay_BHN, do_BSHV, dvnew_in, dfinal, dtype, interpret):
  """The loop over chunks backward: (dS' [B, H, N, K, V], the gradient of the state leaving each chunk, and dV_new
  [B, H, N, C, V], ∂V_new + Kd dS', in `dtype`; the initial state's gradient [B, H, K, V] float32), from Kd, W,
  the decays and the output's cotangents: ∂S_n = (Q ⊙ m exp(Γ))ᵀ dO formed here from q [B, G, N, C, K], Γ, m and
  dO [B, N·C, H, V]; ∂V_new (`output_backward`) and the final state's."""
  b, h, n, c, k = kd.shape
  grid, spec = state_specs(kd, dvnew_in)
  block, sq = block_v(b, h, dvnew_in.shape[-1]), pl.squeezed
  r = h // q_BGNCK.shape[1]
  q_spec = pl.BlockSpec((sq, sq, n, c, k), lambda bi, hi, ji: (bi, hi // r, 0, 0, 0))
  gamma_spec = pl.BlockSpec((sq, sq, n, c), lambda bi, hi, ji: (bi, hi, 0, 0))
  reads_spec = pl.BlockSpec((sq, n, c), lambda bi, hi, ji: (bi, 0, 0))
  do_spec = pl.BlockSpec((sq, n * c, sq, block), lambda bi, hi, ji: (bi, 0, hi, ji))
  out_shape = [jax.ShapeDtypeStruct((b, h, n, k, dvnew_in.shape[-1]), dtype),
               jax.ShapeDtypeStruct(dvnew_in.shape, dtype), jax.ShapeDtypeStruct(dfinal.shape, jnp.float32)]
  kernel = functools.partial(_state_backward_kernel, num_chunks=n, dtype=dtype)
  in_specs = [spec["chunk_k"], spec["chunk_k"], q_spec, gamma_spec, reads_spec, spec["decay"], do_spec,
              spec["chunk_v"], spec["state"]]
  return call(kernel, grid, in_specs, [spec["states"], spec["chunk_v"], spec["state"]], out_shape, interpret,
              "gated_delta_state_backward", STATE_STAGES)(kd, w, q_BGNCK, gamma_BHNC, reads_BNC, decay_BHN, do_BSHV,
                                                          dvnew_in, dfinal)


def _last(x_C, value):
  """x with `value` added at the chunk's last position."""
  return x_C + jnp.where(lax.broadcasted_iota(jnp.int32, x_C.shape, 0) == x_C.shape[0] - 1, value, 0.0)


def _wy_backward_kernel(k_ref, v_ref, beta_ref, gamma_ref, reads_ref, writes_ref, keeps_ref, seg_ref, t_ref,
                        states_ref, dcarry_ref, vnew_ref, dvnew_ref, dk_ref, dv_ref, dbeta_ref, dgamma_ref, *,
                        dtype):
  """One (row, key head, chunk): k_ref [C, K]; per value head r: v_ref, vnew_ref, dvnew_ref [R, C, V], beta_ref,
  gamma_ref [R, C], t_ref [R, C, C], states_ref, dcarry_ref [R, K, V]; reads, writes and documents [C], keeps [1];
  outputs dk_ref [C, K], dv_ref [R, C, V], dbeta_ref, dgamma_ref [R, C]."""
  keys, values = _column_blocks(k_ref.shape[1]), _column_blocks(v_ref.shape[-1])
  kk_CC = sum(dot(k_ref[:, kc], k_ref[:, kc], dtype, trans_b=True) for kc in keys)
  sees_CC = sees_in_chunk(seg_ref[...], diagonal=False)

  # The value heads and the inner loop over V's blocks as loops, not unrolled: fewer tiles live at once (ptxas for an
  # H200 at 1 x 4096: 1196 bytes spilled against 2340 unrolled; `output_backward` spilled more so: it stays
  # unrolled).
  def value_head(r, dk):
    dk = list(dk)
    beta_C, gamma_C, t_CC = beta_ref[r], gamma_ref[r], t_ref[r]
    gamma_end = jnp.sum(jnp.where(lax.broadcasted_iota(jnp.int32, gamma_C.shape, 0) == gamma_C.shape[0] - 1,
                                  gamma_C, 0.0))
    # U = T βV
    dt_CC = jnp.zeros(kk_CC.shape, jnp.float32)
    dbeta_C = jnp.zeros(beta_C.shape, jnp.float32)
    for vc in values:
      dvnew_CJ, v_CJ = dvnew_ref[r, :, vc], v_ref[r, :, vc].astype(jnp.float32)
      dt_CC += dot(dvnew_CJ, v_CJ * beta_C[:, None], dtype, trans_b=True)
      dbv_CJ = dot(t_CC, dvnew_CJ, dtype, trans_a=True)
      dv_ref[r, :, vc] = (dbv_CJ * beta_C[:, None]).astype(dv_ref.dtype)
      dbeta_C += jnp.sum(dbv_CJ * v_CJ, axis=1)
    # W = T Xw, Xw = K ⊙ β m exp(Γ); Kd = K ⊙ e exp(Γ_C − Γ); the state's decay d = c exp(Γ_C)
    read_C = reads_ref[...] * jnp.exp(gamma_C)
    write_C = writes_ref[...] * jnp.exp(gamma_end - gamma_C)
    state_decay = jnp.sum(keeps_ref[...]) * jnp.exp(gamma_end)
    dgamma_C = jnp.zeros(gamma_C.shape, jnp.float32)
    to_end = jnp.zeros((), jnp.float32)  # dΓ at the chunk's last position: through Kd's and d's exp(Γ_C)
    for i, kc in enumerate(keys):
      def value_block(j, carry):
        dw_CJ, dkd_CJ, to_end = carry
        vc = _block(j, values[0].size)
        s_JV, dcarry_JV = states_ref[r, kc, vc], dcarry_ref[r, kc, vc]
        dw_CJ -= dot(dvnew_ref[r, :, vc], s_JV, dtype, trans_b=True)
        dkd_CJ += dot(vnew_ref[r, :, vc], dcarry_JV, dtype, trans_b=True)
        to_end += jnp.sum(s_JV.astype(jnp.float32) * dcarry_JV.astype(jnp.float32)) * state_decay
        return dw_CJ, dkd_CJ, to_end

      zeros_CJ = jnp.zeros((kk_CC.shape[0], kc.size), jnp.float32)
      dw_CJ, dkd_CJ, to_end = lax.fori_loop(0, len(values), value_block, (zeros_CJ, zeros_CJ, to_end))
      k_CJ = k_ref[:, kc].astype(jnp.float32)
      xw_CJ = k_CJ * (beta_C * read_C)[:, None]
      dt_CC += dot(dw_CJ, xw_CJ, dtype, trans_b=True)
      dxw_CJ = dot(t_CC, dw_CJ, dtype, trans_a=True)
      dk[i] += dxw_CJ * (beta_C * read_C)[:, None] + dkd_CJ * write_C[:, None]
      dbeta_C += jnp.sum(dxw_CJ * k_CJ, axis=1) * read_C
      gkd_C = jnp.sum(dkd_CJ * k_CJ, axis=1) * write_C
      dgamma_C += jnp.sum(dxw_CJ * xw_CJ, axis=1) - gkd_C
      to_end += jnp.sum(gkd_C)
    dgamma_C = _last(dgamma_C, to_end)
    # A = strictly lower (diag(β) K Kᵀ) ⊙ D, dA = −Tᵀ dT Tᵀ
    da_CC = -dot(dot(t_CC, dt_CC, dtype, trans_a=True), t_CC, dtype, trans_b=True)
    d_CC = decay(gamma_C, gamma_C, sees_CC)
    dkk_CC = da_CC * d_CC * beta_C[:, None]
    for i, kc in enumerate(keys):
      k_CJ = k_ref[:, kc]
      dk[i] += dot(dkk_CC, k_CJ, dtype) + dot(dkk_CC, k_CJ, dtype, trans_a=True)
    g_CC = dkk_CC * kk_CC
    dbeta_ref[r] = dbeta_C + jnp.sum(da_CC * d_CC * kk_CC, axis=1)
    dgamma_ref[r] = dgamma_C + jnp.sum(g_CC, axis=1) - jnp.sum(g_CC, axis=0)
    return tuple(dk)

  zeros = tuple(jnp.zeros((kk_CC.shape[0], kc.size), jnp.float32) for kc in keys)
  dk = lax.fori_loop(0, beta_ref.shape[0], value_head, zeros)
  for i, kc in enumerate(keys):
    dk_ref[:, kc] = dk[i]


def wy_backward(k_BGNCK, v_BHNCV, beta_BHNC, gamma_BHNC, masks, seg_BNC, t_BHNCC, states_BHNKV, dcarry_BHNKV,
                vnew_BHNCV, dvnew_BHNCV, dtype, interpret):
  """(dK [B, G, N, C, K] float32, dV [B, H, N, C, V] in v's dtype, dβ and dΓ [B, H, N, C] float32) through W, U, T,
  A, Kd and the state's decay, from the state pass's dS' and dV_new (`state_backward`) and the forward's T, S_n and
  V_new; `masks` the chunks' (`gated_delta_chunks.Masks`)."""
  b, hk, n, c, k = k_BGNCK.shape
  h, v = v_BHNCV.shape[1], v_BHNCV.shape[-1]
  key, value, position = _by_key_head(b, hk, h // hk, n, c)
  keeps = pl.BlockSpec((pl.squeezed, pl.squeezed, 1), lambda bi, gi, ni: (bi, ni, 0))
  f32 = lambda shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  out_shape = [f32(k_BGNCK.shape), jax.ShapeDtypeStruct(v_BHNCV.shape, v_BHNCV.dtype), f32(beta_BHNC.shape),
               f32(gamma_BHNC.shape)]
  in_specs = [key(c, k), value(c, v), value(c), value(c), position, position, keeps, position, value(c, c),
              value(k, v), value(k, v), value(c, v), value(c, v)]
  return call(functools.partial(_wy_backward_kernel, dtype=dtype), (b, hk, n), in_specs,
              [key(c, k), value(c, v), value(c), value(c)], out_shape, interpret, "gated_delta_wy_backward")(
                  k_BGNCK, v_BHNCV, beta_BHNC, gamma_BHNC, masks.reads_BNC, masks.writes_BNC,
                  masks.keeps_BN[..., None], seg_BNC, t_BHNCC, states_BHNKV, dcarry_BHNKV, vnew_BHNCV, dvnew_BHNCV)
