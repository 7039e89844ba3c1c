"""The gated delta rule's kernel path (`gated_delta_rule(state_kernel="pallas")`): the chunked form (`gated_delta`'s
docstring) forward on `gated_delta_kernels`' three kernels and backward on `gated_delta_backward_kernels`' five, in
head-major layout ([B, H, N, C, ·]) but v and dO, read where they lie ([B, N, C, H, V], a free reshape of
[B, S, H, V]), q and k at their key heads, with XLA's elementwise work around them: normalising q and k, Γ, the
chunks' decays, and their VJP (but k's: `wy_backward` writes dk whole).

Shape letters: see relaymoe_jax (the gated delta rule's own).
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from models.attention import gated_delta_chunks as gdc
from models.attention.gated_delta_backward_kernels import (output_backward, output_value_backward, state_backward,
                                                           state_inputs_backward, wy_backward)
from models.attention.gated_delta_kernels import BLOCK, chunk_output, chunk_wy, state_forward, takes_the_kernels


def _per_platform(call, *args):
  """`call(*args, interpret)`: the kernels compiled by Triton where the program is lowered for CUDA (whatever machine
  lowers it: compile-only planning too), in Pallas' interpreter elsewhere."""
  return lax.platform_dependent(*args, cuda=lambda *a: call(*a, False), default=lambda *a: call(*a, True))


class _HeadChunks(NamedTuple):
  """The kernel path's inputs in chunks, head-major ([B, H, N, C, ·]: every matmul's batch dimensions lead, so XLA
  moves no operand), q and k at their key heads (value head h = key head g, repeat r); v sequence-major as it came
  (the kernels that read it index its heads: no transpose of the largest input)."""
  q_BGNCK: jax.Array  # normalised, float32 (the kernels round it to their operand dtype)
  k_BGNCK: jax.Array
  v_BNCHV: jax.Array  # v's dtype
  gamma_BHNC: jax.Array  # Γ, the chunk's cumulative log decay, float32
  beta_BHNC: jax.Array  # float32


def _head_major(x_BS_, chunk_size):
  """[B, S, H, ...] → [B, H, N, C, ...] (one transpose), right-padding S to a multiple of C."""
  return jnp.moveaxis(gdc.to_chunks(x_BS_, chunk_size), 3, 1)


def _head_chunks(q, k, v, g, beta, chunk_size, l2_normalize):
  """The kernels' inputs from the rule's, in XLA (the backward differentiates it)."""
  q_BSGK, k_BSGK = gdc.normalize_qk(q, k, l2_normalize)
  return _HeadChunks(_head_major(q_BSGK, chunk_size), _head_major(k_BSGK, chunk_size), gdc.to_chunks(v, chunk_size),
                     jnp.cumsum(_head_major(g.astype(jnp.float32), chunk_size), axis=-1),
                     _head_major(beta.astype(jnp.float32), chunk_size))


class _Chunks(NamedTuple):
  """Everything but the inputs that the kernels share, forward and backward."""
  q_BGNCK: jax.Array  # in the operand dtype
  k_BGNCK: jax.Array
  masks: gdc.Masks
  seg_BNC: jax.Array
  decay_BHN: jax.Array  # c exp(Γ_C)


def _k_scale(k, chunk_size, l2_normalize):
  """k's L2 scale r [B, G, N, C] (ones without the norm): `wy_backward` takes dK through the norm with it."""
  k_BSG = gdc.l2_scale(k.astype(jnp.float32)) if l2_normalize else jnp.ones(k.shape[:-1], jnp.float32)
  return _head_major(k_BSG, chunk_size)


def _chunks(x, seg_BS, chunk_size, dtype):
  masks = gdc.chunk_masks(seg_BS, chunk_size)
  return _Chunks(x.q_BGNCK.astype(dtype), x.k_BGNCK.astype(dtype), masks, gdc.to_chunks(seg_BS, chunk_size, "edge"),
                 masks.keeps_BN[:, None] * jnp.exp(x.gamma_BHNC[..., -1]))


def _state_pass(x, ch, state_BHKV, dtype):
  """(T, W, S_n, V_new, final state): T, U and W by `chunk_wy`'s kernel, then the loop over chunks."""
  t_BHNCC, u_BHNCV, w_BHNCK = _per_platform(lambda *a: chunk_wy(*a[:-1], dtype, a[-1]), ch.k_BGNCK, x.v_BNCHV,
                                            x.beta_BHNC, x.gamma_BHNC, ch.masks.reads_BNC, ch.seg_BNC)
  states_BHNKV, vnew_BHNCV, final_BHKV = _per_platform(
      lambda *a: state_forward(*a[:-1], dtype, a[-1]), ch.k_BGNCK, x.gamma_BHNC, ch.masks.writes_BNC, w_BHNCK,
      u_BHNCV, ch.decay_BHN, state_BHKV)
  return t_BHNCC, w_BHNCK, states_BHNKV, vnew_BHNCV, final_BHKV


def _operand_dtype(v):
  return jnp.float32 if v.dtype == jnp.float32 else jnp.bfloat16


def _forward(q, k, v, g, beta, seg_BS, state_BHKV, chunk_size, l2_normalize):
  """((o, final state), (T, W, S_n, V_new): what the backward needs of the state pass)."""
  dtype = _operand_dtype(v)
  x = _head_chunks(q, k, v, g, beta, chunk_size, l2_normalize)
  ch = _chunks(x, seg_BS, chunk_size, dtype)
  t_BHNCC, w_BHNCK, states_BHNKV, vnew_BHNCV, final_BHKV = _state_pass(x, ch, state_BHKV, dtype)
  o_BSHV = _per_platform(lambda *a: chunk_output(*a[:-1], v.dtype, dtype, a[-1]), ch.q_BGNCK, ch.k_BGNCK,
                         x.gamma_BHNC, ch.masks.reads_BNC, ch.seg_BNC, states_BHNKV, vnew_BHNCV)
  return (o_BSHV[:, :v.shape[1]], final_BHKV), (t_BHNCC, w_BHNCK, states_BHNKV, vnew_BHNCV)


def kernel_chunked_forward(q, k, v, g, beta, seg_BS, state_BHKV, chunk_size, l2_normalize, keep_state_pass):
  """The chunked form with the Pallas kernels (`gated_delta_kernels`): each chunk's T, U and W, the loop over chunks
  and each chunk's output as kernels (the decayed keys formed in the loop's), the chunks' decays XLA's, q and k at
  their key heads; operands bfloat16 unless v is float32. Returns (o [B, S, H, V] in v's dtype, final state
  float32).

  Its VJP keeps the inputs and, with `keep_state_pass`, what the backward needs of the state pass: each chunk's T, W,
  entering state and V_new (about 4.5 times v's size at C = 64, K = V = 128; the backward then reruns neither
  `chunk_wy`, the forward's costliest kernel, nor the loop over chunks); without it the backward reruns both for
  them. Then it runs `gated_delta_backward_kernels`' five kernels."""
  if not takes_the_kernels(chunk_size):
    raise ValueError(f"chunk_size={chunk_size}: the Pallas kernels take a power of 2, at least {BLOCK}")
  return _kernel_chunked(q, k, v, g, beta, seg_BS, state_BHKV.astype(jnp.float32), chunk_size, l2_normalize,
                         keep_state_pass)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _kernel_chunked(q, k, v, g, beta, seg_BS, state_BHKV, chunk_size, l2_normalize, keep_state_pass):
  return _forward(q, k, v, g, beta, seg_BS, state_BHKV, chunk_size, l2_normalize)[0]


def _kernel_chunked_fwd(q, k, v, g, beta, seg_BS, state_BHKV, chunk_size, l2_normalize, keep_state_pass):
  out, passed = _forward(q, k, v, g, beta, seg_BS, state_BHKV, chunk_size, l2_normalize)
  return out, (q, k, v, g, beta, seg_BS, state_BHKV, passed if keep_state_pass else None)


def _kernel_chunked_bwd(chunk_size, l2_normalize, keep_state_pass, residuals, cotangents):
  q, k, v, g, beta, seg_BS, state_BHKV, passed = residuals
  do_BSHV, dfinal_BHKV = cotangents
  dtype = _operand_dtype(v)
  # k's gradient leaves `wy_backward` whole (through its norm, in k's layout): XLA's VJP takes the other inputs
  x, inputs_vjp = jax.vjp(lambda q, v, g, beta: _head_chunks(q, k, v, g, beta, chunk_size, l2_normalize), q, v, g,
                          beta)
  ch = _chunks(x, seg_BS, chunk_size, dtype)
  if passed is None:
    passed = _state_pass(x, ch, state_BHKV, dtype)[:4]
  t_BHNCC, w_BHNCK, states_BHNKV, vnew_BHNCV = passed
  do_BSHV = jnp.pad(do_BSHV, [(0, 0), (0, -v.shape[1] % chunk_size), (0, 0), (0, 0)])
  dq_BGNCK, dk_BGNCK, dgamma_BHNC = _per_platform(
      lambda *a: output_backward(*a[:-1], dtype, a[-1]), ch.q_BGNCK, ch.k_BGNCK, x.gamma_BHNC,
      ch.masks.reads_BNC, ch.seg_BNC, states_BHNKV, vnew_BHNCV, do_BSHV)
  dvnew_BHNCV = _per_platform(lambda *a: output_value_backward(*a[:-1], dtype, a[-1]), ch.q_BGNCK, ch.k_BGNCK,
                              x.gamma_BHNC, ch.seg_BNC, do_BSHV)
  dcarry_BHNKV, dvnew_BHNCV, dstate_BHKV = _per_platform(
      lambda *a: state_backward(a[0], a[1], ch.masks, *a[2:-1], dtype, a[-1]), ch.k_BGNCK, x.gamma_BHNC, w_BHNCK,
      ch.q_BGNCK, ch.decay_BHN, do_BSHV, dvnew_BHNCV, dfinal_BHKV)
  dw_BHNCK, dk_kd_BGNCK, dgamma_kd_BHNC = _per_platform(
      lambda *a: state_inputs_backward(a[0], a[1], ch.masks, *a[2:-1], dtype, a[-1]), ch.k_BGNCK, x.gamma_BHNC,
      states_BHNKV, dcarry_BHNKV, vnew_BHNCV, dvnew_BHNCV)
  dk_BNCGK, dv_BNCHV, dbeta_BHNC, dgamma_wy_BHNC = _per_platform(
      lambda *a: wy_backward(*a[:-1], k.dtype, l2_normalize, dtype, a[-1]), ch.k_BGNCK, x.v_BNCHV, x.beta_BHNC,
      x.gamma_BHNC, ch.masks.reads_BNC, ch.seg_BNC, t_BHNCC, dw_BHNCK, dvnew_BHNCV, dk_BGNCK, dk_kd_BGNCK,
      _k_scale(k, chunk_size, l2_normalize))
  dq, dv, dg, dbeta = inputs_vjp(_HeadChunks(dq_BGNCK, jnp.zeros_like(x.k_BGNCK), dv_BNCHV,
                                             dgamma_BHNC + dgamma_kd_BHNC + dgamma_wy_BHNC, dbeta_BHNC))
  b, n, c, hk, kd = dk_BNCGK.shape
  return dq, dk_BNCGK.reshape(b, n * c, hk, kd)[:, :k.shape[1]], dv, dg, dbeta, None, dstate_BHKV


_kernel_chunked.defvjp(_kernel_chunked_fwd, _kernel_chunked_bwd)
