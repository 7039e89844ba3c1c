"""The gated delta rule's backward in five Pallas (Triton) kernels, on the chunked form (`gated_delta`'s docstring) in
head-major layout, q and k at their key heads; `gated_delta_kernel_path` runs them after rerunning the forward's
state pass. With S_n the state entering chunk n, V_new its new values and dS' the gradient of the state leaving it:

- `output_value_backward`, from dO: of O = Qd S_n + P V_new (Qd = Q ⊙ m exp(Γ), P = (Q Kᵀ) ⊙ D) the cotangent
  ∂V_new = Pᵀ dO that the state pass's backward takes.
- `output_backward`, from dO: the same O's dQ, dK, dΓ, one block of K's columns per program:
    dQd = dO S_nᵀ,  dP = dO V_newᵀ,  dQ = dQd ⊙ m exp(Γ) + (dP ⊙ D) K,  dK = (dP ⊙ D)ᵀ Q,
    dΓ_r = Σ_k dQd ⊙ Qd + Σ_s (dP ⊙ P)_rs − Σ_s (dP ⊙ P)_sr.
- `state_backward`: the loop over chunks from the last down (`gated_delta_kernels`' docstring), forming S_n's
  cotangent ∂S_n = Qdᵀ dO in the loop (fla's choice: it never reaches memory).
- `state_inputs_backward`, from the state pass's dS' and dV_new: of V_new = U − W S_n and S_{n+1} = d S_n + Kdᵀ V_new
  (Kd = K ⊙ e exp(Γ_C − Γ), d = c exp(Γ_C)):
    dW = −dV_new S_nᵀ (to memory, for `wy_backward`),  dKd = V_new dS'ᵀ,  dd = Σ S_n ⊙ dS',
  then through Kd and d to dK and dΓ.
- `wy_backward`, from dV_new, dW and the forward's T = (I + A)⁻¹: of U = T βV, W = T Xw (Xw = K ⊙ β m exp(Γ)),
  A = strictly lower (diag(β) K Kᵀ) ⊙ D:
    dT = dV_new (βV)ᵀ + dW Xwᵀ,  dV = β ⊙ Tᵀ dV_new,  dXw = Tᵀ dW,  dA = −Tᵀ dT Tᵀ,
  then through Xw and A to dK, dβ and dΓ; with the other two kernels' dK added, through k's L2 norm to the rule's
  own dk (k̂ = k r: dk = r (dK − k̂ Σ dK ⊙ k̂)), written in k's layout.

Split so (fla's split too): one kernel holding every one of these [C, 64] float32 tiles spilled its registers (ptxas
for an H200 at 16 × 4096: 255 registers and 1224 bytes spilled in `wy_backward` with W's and Kd's terms inside, 872
bytes in `output_backward` with ∂V_new inside and its K blocks a loop); split, they spill 36–244 bytes, and an H100
ran the backward 1.0 ms faster at 16 × 4096 though dW and the partial dK make a round trip through memory.

The programs of `output_backward` (and one block of K), `state_inputs_backward` (a run of chunks) and `wy_backward`
take one (row, key head, chunk) and its value heads in turn, so dQ and dK sum over them on chip: dQ and the first two
dK parts leave in float32 at the key heads, `wy_backward` reads those dK parts and writes dk whole (XLA's sum of the
three float32 parts alone took 1.15 ms; one H100 at 16 × 4096, forward + backward 23.17 → 22.14 ms); the other
gradients are per value head, float32 (dV in v's dtype). Key and value columns go in
blocks of BLOCK_V. Each takes `interpret` as the forward kernels do.

Shape letters: see relaymoe_jax (the gated delta rule's own).
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from models.attention.gated_delta_kernels import (BLOCK_V, STATE_STAGES, call, chunk_end, decay, dot, over_chunks,
                                                  run_length, run_stages, sees_in_chunk, state_specs, write_decays)

# The most chunks a program of these kernels takes in turn (`gated_delta_kernels.WY_CHUNKS`). One H100, 16 x 4096,
# runs of 4 against one chunk a program: state_inputs_backward 2.27 -> 2.07 ms (output_value_backward, under 1.1 ms
# either way, not timed alone); runs made output_backward (3.16 -> 3.40 ms, its spills 172 -> 352 bytes) and
# wy_backward (2.23 -> 2.87) slower, so they take one chunk a program.
OUTPUT_VALUE_CHUNKS = 4
STATE_INPUTS_CHUNKS = 4


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
                            dq_ref, dk_ref, dgamma_ref, *, dtype):
  """One (row, key head, chunk, block of K's columns): q_ref, k_ref [C, K]; per value head r: gamma_ref [R, C],
  states_ref [R, K, V], vnew_ref [R, C, V], do_ref [C, R, V] (the output's layout); outputs dq_ref, dk_ref [C, J]
  (the block's columns), dgamma_ref [R, C] (the block's share: P's terms in the first block's)."""
  keys, values = _column_blocks(q_ref.shape[1]), _column_blocks(vnew_ref.shape[-1])
  kc = _block(pl.program_id(3), dq_ref.shape[-1])
  first = (pl.program_id(3) == 0).astype(jnp.float32)
  q_CJ, k_CJ = q_ref[:, kc], k_ref[:, kc]

  # In the order that keeps the fewest [C, C] float32 tiles live (ptxas: the fewest bytes spilled).
  def value_head(r, carry):
    dq_CJ, dk_CJ = carry
    gamma_C = gamma_ref[r]
    scale_C = reads_ref[...] * jnp.exp(gamma_C)
    dqd_CJ = sum(dot(do_ref[:, r, vc], states_ref[r, kc, vc], dtype, trans_b=True) for vc in values)
    dq_CJ += dqd_CJ * scale_C[:, None]
    dgamma_C = jnp.sum(dqd_CJ * q_CJ.astype(jnp.float32), axis=1) * scale_C
    ds_CC = (sum(dot(do_ref[:, r, vc], vnew_ref[r, :, vc], dtype, trans_b=True) for vc in values)
             * decay(gamma_C, gamma_C, sees_in_chunk(seg_ref[...])))
    g_CC = ds_CC * sum(dot(q_ref[:, kb], k_ref[:, kb], dtype, trans_b=True) for kb in keys)
    dgamma_ref[r] = dgamma_C + first * (jnp.sum(g_CC, axis=1) - jnp.sum(g_CC, axis=0))
    return dq_CJ + dot(ds_CC, k_CJ, dtype), dk_CJ + dot(ds_CC, q_CJ, dtype, trans_a=True)

  zeros = jnp.zeros(dq_ref.shape, jnp.float32)
  dq_ref[...], dk_ref[...] = lax.fori_loop(0, gamma_ref.shape[0], value_head, (zeros, zeros))


def _by_key_head(r, c, run=pl.squeezed):
  """BlockSpec makers over the grid (row, key head, chunk or run of `run` chunks)."""
  sq = pl.squeezed
  key = lambda *tail: pl.BlockSpec((sq, sq, run) + tail, lambda bi, gi, ni: (bi, gi, ni) + (0,) * len(tail))
  value = lambda *tail: pl.BlockSpec((sq, r, run) + tail, lambda bi, gi, ni: (bi, gi, ni) + (0,) * len(tail))
  position = pl.BlockSpec((sq, run, c), lambda bi, gi, ni: (bi, ni, 0))
  return key, value, position


def output_backward(q_BGNCK, k_BGNCK, gamma_BHNC, reads_BNC, seg_BNC, states_BHNKV, vnew_BHNCV, do_BSHV, dtype,
                    interpret):
  """(dQ, dK [B, G, N, C, K], dΓ [B, H, N, C], float32) of the forward's `chunk_output` from dO [B, N·C, H, V]
  (∂V_new: `output_value_backward`; ∂S_n: `state_backward` forms it in its loop). One program per (row, key head,
  chunk, block of K's columns)."""
  b, hk, n, c, k = q_BGNCK.shape
  h, v = vnew_BHNCV.shape[1], vnew_BHNCV.shape[-1]
  r, block, sq = h // hk, math.gcd(k, BLOCK_V), pl.squeezed
  spec = lambda shape, index: pl.BlockSpec(shape, lambda bi, gi, ni, ji: index(bi, gi, ni, ji))
  key = spec((sq, sq, sq, c, k), lambda bi, gi, ni, ji: (bi, gi, ni, 0, 0))
  key_block = spec((sq, sq, sq, c, block), lambda bi, gi, ni, ji: (bi, gi, ni, 0, ji))
  position = spec((sq, sq, c), lambda bi, gi, ni, ji: (bi, ni, 0))
  value = lambda *tail: spec((sq, r, sq) + tail, lambda bi, gi, ni, ji: (bi, gi, ni) + (0,) * len(tail))
  do_spec = spec((sq, c, r, v), lambda bi, gi, ni, ji: (bi, ni, gi, 0))
  dgamma_spec = spec((sq, sq, r, sq, c), lambda bi, gi, ni, ji: (ji, bi, gi, ni, 0))
  f32 = lambda shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  dq, dk, dgamma = call(functools.partial(_output_backward_kernel, dtype=dtype), (b, hk, n, k // block),
                        [key, key, value(c), position, position, value(k, v), value(c, v), do_spec],
                        [key_block, key_block, dgamma_spec],
                        [f32(q_BGNCK.shape), f32(k_BGNCK.shape), f32((k // block,) + gamma_BHNC.shape)], interpret,
                        "gated_delta_output_backward")(
                            q_BGNCK, k_BGNCK, gamma_BHNC, reads_BNC, seg_BNC, states_BHNKV, vnew_BHNCV, do_BSHV)
  return dq, dk, jnp.sum(dgamma, axis=0)


def _output_value_backward_kernel(q_ref, k_ref, gamma_ref, seg_ref, do_ref, dvnew_ref, *, dtype):
  """One (row, value head, chunk): ∂V_new [C, V] = Pᵀ dO, P = (Q Kᵀ) ⊙ D."""
  keys = _column_blocks(q_ref.shape[1])
  gamma_C = gamma_ref[...]
  p_CC = (sum(dot(q_ref[:, kc], k_ref[:, kc], dtype, trans_b=True) for kc in keys)
          * decay(gamma_C, gamma_C, sees_in_chunk(seg_ref[...])))
  for vc in _column_blocks(do_ref.shape[-1]):
    dvnew_ref[:, vc] = dot(p_CC, do_ref[:, vc], dtype, trans_a=True).astype(dvnew_ref.dtype)


def output_value_backward(q_BGNCK, k_BGNCK, gamma_BHNC, seg_BNC, do_BSHV, dtype, interpret):
  """∂V_new [B, H, N, C, V] in `dtype`, the cotangent of the forward's `chunk_output` that reaches V_new (the state
  pass's backward takes it), from dO [B, N·C, H, V]. One program per (row, value head, run of up to
  OUTPUT_VALUE_CHUNKS chunks)."""
  b, hk, n, c, k = q_BGNCK.shape
  h, v = gamma_BHNC.shape[1], do_BSHV.shape[-1]
  sq, per = pl.squeezed, run_length(n, OUTPUT_VALUE_CHUNKS)
  key = pl.BlockSpec((sq, sq, per, c, k), lambda bi, hi, ni: (bi, hi // (h // hk), ni, 0, 0))
  in_specs = [key, key, pl.BlockSpec((sq, sq, per, c), lambda bi, hi, ni: (bi, hi, ni, 0)),
              pl.BlockSpec((sq, per, c), lambda bi, hi, ni: (bi, ni, 0)),
              pl.BlockSpec((sq, per, c, sq, v), lambda bi, hi, ni: (bi, ni, 0, hi, 0))]
  out_spec = pl.BlockSpec((sq, sq, per, c, v), lambda bi, hi, ni: (bi, hi, ni, 0, 0))
  kernel = over_chunks(functools.partial(_output_value_backward_kernel, dtype=dtype), (0,) * 6)
  return call(kernel, (b, h, n // per), in_specs, out_spec, jax.ShapeDtypeStruct((b, h, n, c, v), dtype), interpret,
              "gated_delta_output_value_backward", run_stages(per))(
                  q_BGNCK, k_BGNCK, gamma_BHNC, seg_BNC, do_BSHV.reshape(b, n, c, h, v))


def _state_backward_kernel(k_ref, gamma_ref, writes_ref, reads_ref, w_ref, q_ref, decay_ref, do_ref, dvnew_in_ref,
                           dfinal_ref, dcarry_ref, dvnew_ref, dstate_ref, *, num_chunks, dtype):
  c = q_ref.shape[1]

  def chunk(i, ds_KJ):
    n = num_chunks - 1 - i
    dcarry_ref[n] = ds_KJ.astype(dcarry_ref.dtype)
    gamma_C = gamma_ref[n]
    kd_CK = k_ref[n].astype(jnp.float32) * write_decays(gamma_C, writes_ref[n])[:, None]
    dvnew_CJ = dvnew_in_ref[n].astype(jnp.float32) + dot(kd_CK, ds_KJ, dtype)
    dvnew_ref[n] = dvnew_CJ.astype(dvnew_ref.dtype)
    qd_CK = q_ref[n].astype(jnp.float32) * (reads_ref[n] * jnp.exp(gamma_C))[:, None]
    return (decay_ref[pl.ds(n, 1)] * ds_KJ + dot(qd_CK, do_ref[pl.ds(n * c, c)], dtype, trans_a=True)
            - dot(w_ref[n], dvnew_CJ, dtype, trans_a=True))

  dstate_ref[...] = lax.fori_loop(0, num_chunks, chunk, dfinal_ref[...].astype(jnp.float32))


def state_backward(k_BGNCK, gamma_BHNC, masks, w, q_BGNCK, decay_BHN, do_BSHV, dvnew_in, dfinal, dtype, interpret):
  """The loop over chunks backward: (dS' [B, H, N, K, V], the gradient of the state leaving each chunk, and dV_new
  [B, H, N, C, V], ∂V_new + Kd dS', in `dtype`; the initial state's gradient [B, H, K, V] float32), from the keys
  (Kd formed here, as `state_forward` does), W, the decays and the output's cotangents: ∂S_n = (Q ⊙ m exp(Γ))ᵀ dO
  formed here from q [B, G, N, C, K], Γ, m and dO [B, N·C, H, V]; ∂V_new (`output_backward`) and the final
  state's; `masks` the chunks' (`gated_delta_chunks.Masks`)."""
  b, h, n, c, k = w.shape
  grid, spec = state_specs(k_BGNCK, dvnew_in)
  block = dvnew_in.shape[-1] // grid[-1]
  do_spec = pl.BlockSpec((pl.squeezed, n * c, pl.squeezed, block), lambda bi, hi, ji: (bi, 0, hi, ji))
  out_shape = [jax.ShapeDtypeStruct((b, h, n, k, dvnew_in.shape[-1]), dtype),
               jax.ShapeDtypeStruct(dvnew_in.shape, dtype), jax.ShapeDtypeStruct(dfinal.shape, jnp.float32)]
  kernel = functools.partial(_state_backward_kernel, num_chunks=n, dtype=dtype)
  in_specs = [spec["key_k"], spec["per_head"], spec["per_position"], spec["per_position"], spec["chunk_k"],
              spec["key_k"], spec["decay"], do_spec, spec["chunk_v"], spec["state"]]
  return call(kernel, grid, in_specs, [spec["states"], spec["chunk_v"], spec["state"]], out_shape, interpret,
              "gated_delta_state_backward", STATE_STAGES)(
                  k_BGNCK, gamma_BHNC, masks.writes_BNC, masks.reads_BNC, w, q_BGNCK, decay_BHN, do_BSHV, dvnew_in,
                  dfinal)


def _last(x_C, value):
  """x with `value` added at the chunk's last position."""
  return x_C + jnp.where(lax.broadcasted_iota(jnp.int32, x_C.shape, 0) == x_C.shape[0] - 1, value, 0.0)


def _state_inputs_backward_kernel(k_ref, gamma_ref, writes_ref, keeps_ref, states_ref, dcarry_ref, vnew_ref,
                                  dvnew_ref, dw_ref, dk_ref, dgamma_ref, *, dtype):
  """One (row, key head, chunk): k_ref [C, K]; per value head r: gamma_ref [R, C], states_ref, dcarry_ref [R, K, V],
  vnew_ref, dvnew_ref [R, C, V]; writes [C], keeps [1]; outputs dw_ref [R, C, K] (in `dtype`), dk_ref [C, K]
  (summed over the value heads), dgamma_ref [R, C]."""
  keys, values = _column_blocks(k_ref.shape[1]), _column_blocks(vnew_ref.shape[-1])

  def value_head(r, dk):
    gamma_C = gamma_ref[r]
    write_C = write_decays(gamma_C, writes_ref[...])
    state_decay = jnp.sum(keeps_ref[...]) * jnp.exp(chunk_end(gamma_C))
    dgamma_C = jnp.zeros(gamma_C.shape, jnp.float32)
    to_end = jnp.zeros((), jnp.float32)  # dΓ at the chunk's last position: through Kd's and d's exp(Γ_C)
    dk = list(dk)
    for i, kc in enumerate(keys):
      def value_block(j, carry):
        dw_CJ, dkd_CJ, to_end = carry
        vc = _block(j, values[0].size)
        s_JV, dcarry_JV = states_ref[r, kc, vc], dcarry_ref[r, kc, vc]
        dw_CJ -= dot(dvnew_ref[r, :, vc], s_JV, dtype, trans_b=True)
        dkd_CJ += dot(vnew_ref[r, :, vc], dcarry_JV, dtype, trans_b=True)
        to_end += jnp.sum(s_JV.astype(jnp.float32) * dcarry_JV.astype(jnp.float32)) * state_decay
        return dw_CJ, dkd_CJ, to_end

      zeros_CJ = jnp.zeros((gamma_C.shape[0], kc.size), jnp.float32)
      dw_CJ, dkd_CJ, to_end = lax.fori_loop(0, len(values), value_block, (zeros_CJ, zeros_CJ, to_end))
      dw_ref[r, :, kc] = dw_CJ.astype(dw_ref.dtype)
      dk[i] += dkd_CJ * write_C[:, None]
      gkd_C = jnp.sum(dkd_CJ * k_ref[:, kc].astype(jnp.float32), axis=1) * write_C
      dgamma_C -= gkd_C
      to_end += jnp.sum(gkd_C)
    dgamma_ref[r] = _last(dgamma_C, to_end)
    return tuple(dk)

  zeros = tuple(jnp.zeros((k_ref.shape[0], kc.size), jnp.float32) for kc in keys)
  dk = lax.fori_loop(0, gamma_ref.shape[0], value_head, zeros)
  for i, kc in enumerate(keys):
    dk_ref[:, kc] = dk[i]


def state_inputs_backward(k_BGNCK, gamma_BHNC, masks, states_BHNKV, dcarry_BHNKV, vnew_BHNCV, dvnew_BHNCV, dtype,
                          interpret):
  """Of V_new = U − W S_n and S_{n+1} = d S_n + Kdᵀ V_new (Kd = K ⊙ e exp(Γ_C − Γ), d = c exp(Γ_C)): (dW = −dV_new
  S_nᵀ [B, H, N, C, K] in `dtype`; dK [B, G, N, C, K] and dΓ [B, H, N, C], float32, through Kd and d), from the
  state pass's dS' and dV_new (`state_backward`) and the forward's S_n and V_new; `masks` the chunks'
  (`gated_delta_chunks.Masks`)."""
  b, hk, n, c, k = k_BGNCK.shape
  h, v = vnew_BHNCV.shape[1], vnew_BHNCV.shape[-1]
  per = run_length(n, STATE_INPUTS_CHUNKS)
  key, value, position = _by_key_head(h // hk, c, per)
  keeps = pl.BlockSpec((pl.squeezed, per, 1), lambda bi, gi, ni: (bi, ni, 0))
  out_shape = [jax.ShapeDtypeStruct((b, h, n, c, k), dtype), jax.ShapeDtypeStruct(k_BGNCK.shape, jnp.float32),
               jax.ShapeDtypeStruct(gamma_BHNC.shape, jnp.float32)]
  in_specs = [key(c, k), value(c), position, keeps, value(k, v), value(k, v), value(c, v), value(c, v)]
  # The run's axis: first in the key head's and the rows' refs, after the value heads in theirs.
  kernel = over_chunks(functools.partial(_state_inputs_backward_kernel, dtype=dtype), (0, 1, 0, 0, 1, 1, 1, 1, 1, 0, 1))
  return call(kernel, (b, hk, n // per), in_specs, [value(c, k), key(c, k), value(c)], out_shape, interpret,
              "gated_delta_state_inputs_backward", run_stages(per))(
                  k_BGNCK, gamma_BHNC, masks.writes_BNC, masks.keeps_BN[..., None], states_BHNKV, dcarry_BHNKV,
                  vnew_BHNCV, dvnew_BHNCV)


def _wy_backward_kernel(k_ref, v_ref, beta_ref, gamma_ref, reads_ref, seg_ref, t_ref, dw_ref, dvnew_ref,
                        dk_output_ref, dk_state_ref, k_scale_ref, dk_ref, dv_ref, dbeta_ref, dgamma_ref, *, dtype,
                        normalized):
  """One (row, key head, chunk): k_ref [C, K]; per value head r: v_ref [C, R, V] (v's layout), dvnew_ref [R, C, V],
  dw_ref [R, C, K], beta_ref, gamma_ref [R, C], t_ref [R, C, C]; reads and documents [C]; the other kernels' dK
  dk_output_ref, dk_state_ref [C, K] and k's L2 scale k_scale_ref [C]; outputs dk_ref [C, K] (k's layout: the
  gradient of the rule's own k), dv_ref [C, R, V], dbeta_ref, dgamma_ref [R, C]."""
  keys, values = _column_blocks(k_ref.shape[1]), _column_blocks(v_ref.shape[-1])
  c = k_ref.shape[0]

  # The value heads as a loop, not unrolled: fewer tiles live at once.
  def value_head(r, dk):
    dk = list(dk)
    beta_C, gamma_C, t_CC = beta_ref[r], gamma_ref[r], t_ref[r]
    # U = T βV
    dt_CC = jnp.zeros((c, c), jnp.float32)
    dbeta_C = jnp.zeros(beta_C.shape, jnp.float32)
    for vc in values:
      dvnew_CJ, v_CJ = dvnew_ref[r, :, vc], v_ref[:, r, vc].astype(jnp.float32)
      dt_CC += dot(dvnew_CJ, v_CJ * beta_C[:, None], dtype, trans_b=True)
      dbv_CJ = dot(t_CC, dvnew_CJ, dtype, trans_a=True)
      dv_ref[:, r, vc] = (dbv_CJ * beta_C[:, None]).astype(dv_ref.dtype)
      dbeta_C += jnp.sum(dbv_CJ * v_CJ, axis=1)
    # W = T Xw, Xw = K ⊙ β m exp(Γ)
    read_C = reads_ref[...] * jnp.exp(gamma_C)
    xw_scale_C = beta_C * read_C
    dgamma_C = jnp.zeros(gamma_C.shape, jnp.float32)
    for i, kc in enumerate(keys):
      dw_CJ, k_CJ = dw_ref[r, :, kc], k_ref[:, kc].astype(jnp.float32)
      xw_CJ = k_CJ * xw_scale_C[:, None]
      dt_CC += dot(dw_CJ, xw_CJ, dtype, trans_b=True)
      dxw_CJ = dot(t_CC, dw_CJ, dtype, trans_a=True)
      dk[i] += dxw_CJ * xw_scale_C[:, None]
      dbeta_C += jnp.sum(dxw_CJ * k_CJ, axis=1) * read_C
      dgamma_C += jnp.sum(dxw_CJ * xw_CJ, axis=1)
    # A = strictly lower (diag(β) K Kᵀ) ⊙ D, dA = −Tᵀ dT Tᵀ
    da_CC = -dot(dot(t_CC, dt_CC, dtype, trans_a=True), t_CC, dtype, trans_b=True)
    d_CC = decay(gamma_C, gamma_C, sees_in_chunk(seg_ref[...], diagonal=False))
    dkk_CC = da_CC * d_CC * beta_C[:, None]
    for i, kc in enumerate(keys):
      k_CJ = k_ref[:, kc]
      dk[i] += dot(dkk_CC, k_CJ, dtype) + dot(dkk_CC, k_CJ, dtype, trans_a=True)
    # K Kᵀ formed here, not held across the loop: fewer tiles live at once (ptxas: 428 → 236 bytes spilled)
    kk_CC = sum(dot(k_ref[:, kc], k_ref[:, kc], dtype, trans_b=True) for kc in keys)
    g_CC = dkk_CC * kk_CC
    dbeta_ref[r] = dbeta_C + jnp.sum(da_CC * d_CC * kk_CC, axis=1)
    dgamma_ref[r] = dgamma_C + jnp.sum(g_CC, axis=1) - jnp.sum(g_CC, axis=0)
    return tuple(dk)

  others = tuple(dk_output_ref[:, kc] + dk_state_ref[:, kc] for kc in keys)
  dk = lax.fori_loop(0, beta_ref.shape[0], value_head, others)
  # Through the L2 norm: k̂ = k r, so dk = r (dk̂ − k̂ Σ dk̂ ⊙ k̂)
  if normalized:
    along_C = sum(jnp.sum(dk[i] * k_ref[:, kc].astype(jnp.float32), axis=1) for i, kc in enumerate(keys))
    dk = [dk[i] - k_ref[:, kc].astype(jnp.float32) * along_C[:, None] for i, kc in enumerate(keys)]
  scale_C = k_scale_ref[...]
  for i, kc in enumerate(keys):
    dk_ref[:, kc] = (dk[i] * scale_C[:, None]).astype(dk_ref.dtype)


def wy_backward(k_BGNCK, v_BNCHV, beta_BHNC, gamma_BHNC, reads_BNC, seg_BNC, t_BHNCC, dw_BHNCK, dvnew_BHNCV,
                dk_output_BGNCK, dk_state_BGNCK, k_scale_BGNC, k_dtype, normalized, dtype, interpret):
  """(dK [B, N, C, G, K] in `k_dtype`, the rule's k's own gradient: dK from `output_backward` and
  `state_inputs_backward` with this kernel's through U = T βV, W = T Xw, T and A, then through k's L2 norm (k̂ = k r,
  r `k_scale` [B, G, N, C]; with `normalized` false, k̂ = k and r = 1); dV [B, N, C, H, V] in v's dtype (v's layout),
  dβ and dΓ [B, H, N, C] float32), from dV_new (`state_backward`), dW (`state_inputs_backward`) and the forward's
  T. dK leaves in the rule's layout: XLA sums no float32 partials and moves nothing back."""
  b, hk, n, c, k = k_BGNCK.shape
  h, v = v_BNCHV.shape[3:]
  r = h // hk
  key, value, position = _by_key_head(r, c)
  values = pl.BlockSpec((pl.squeezed, pl.squeezed, c, r, v), lambda bi, gi, ni: (bi, ni, 0, gi, 0))
  dk_spec = pl.BlockSpec((pl.squeezed, pl.squeezed, c, pl.squeezed, k), lambda bi, gi, ni: (bi, ni, 0, gi, 0))
  f32 = lambda shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  out_shape = [jax.ShapeDtypeStruct((b, n, c, hk, k), k_dtype), jax.ShapeDtypeStruct(v_BNCHV.shape, v_BNCHV.dtype),
               f32(beta_BHNC.shape), f32(gamma_BHNC.shape)]
  in_specs = [key(c, k), values, value(c), value(c), position, position, value(c, c), value(c, k), value(c, v),
              key(c, k), key(c, k), key(c)]
  kernel = functools.partial(_wy_backward_kernel, dtype=dtype, normalized=normalized)
  return call(kernel, (b, hk, n), in_specs, [dk_spec, values, value(c), value(c)], out_shape, interpret,
              "gated_delta_wy_backward")(
                  k_BGNCK, v_BNCHV, beta_BHNC, gamma_BHNC, reads_BNC, seg_BNC, t_BHNCC, dw_BHNCK, dvnew_BHNCV,
                  dk_output_BGNCK, dk_state_BGNCK, k_scale_BGNC)
