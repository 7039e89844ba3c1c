"""The gated delta rule's kernel path (`gated_delta_rule(state_kernel="pallas")`): the chunked form (`gated_delta`'s
docstring) on `gated_delta_kernels`' three kernels, in head-major layout ([B, H, N, C, ·]), q and k at their key
heads, with XLA's elementwise work around them: normalising q and k, Γ, the decayed keys and the chunks' decays.

Shape letters: see relaymoe_jax (the gated delta rule's own).
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from models.attention import gated_delta_chunks as gdc
from models.attention.gated_delta_kernels import (BLOCK, chunk_output, chunk_wy, scaled, state_pass, takes_the_kernels,
                                                  wy_from_inverse)


def _per_platform(call, *args):
  """`call(*args, interpret)`: the kernels compiled by Triton where the program is lowered for CUDA (whatever machine
  lowers it: compile-only planning too), in Pallas' interpreter elsewhere."""
  return lax.platform_dependent(*args, cuda=lambda *a: call(*a, False), default=lambda *a: call(*a, True))


class _HeadChunks(NamedTuple):
  """The kernel path's inputs in chunks, head-major ([B, H, N, C, ·]: every matmul's batch dimensions lead, so XLA
  moves no operand), q and k at their key heads (value head h = key head g, repeat r)."""
  q_BGNCK: jax.Array  # normalised, in the operand dtype
  k_BGNCK: jax.Array
  v_BHNCV: jax.Array
  gamma_BGRNC: jax.Array  # Γ, the chunk's cumulative log decay, float32
  beta_BHNC: jax.Array


def _head_major(x_BS_, chunk_size):
  """[B, S, H, ...] → [B, H, N, C, ...] (one transpose), right-padding S to a multiple of C."""
  x_BHS_ = jnp.moveaxis(x_BS_, 2, 1)
  pad = -x_BHS_.shape[2] % chunk_size
  x_BHS_ = jnp.pad(x_BHS_, [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * (x_BHS_.ndim - 3))
  return x_BHS_.reshape(*x_BHS_.shape[:2], -1, chunk_size, *x_BHS_.shape[3:])


def _head_chunks(q, k, v, g, beta, chunk_size, l2_normalize, dtype):
  b, _, hk, _ = k.shape
  q_BSGK, k_BSGK = gdc.normalize_qk(q, k, v.shape[2], l2_normalize)
  q_BGNCK, k_BGNCK = (_head_major(x.astype(dtype), chunk_size) for x in (q_BSGK, k_BSGK))
  n = q_BGNCK.shape[2]
  g_BGRNC = _head_major(g.astype(jnp.float32), chunk_size).reshape(b, hk, -1, n, chunk_size)
  return _HeadChunks(q_BGNCK, k_BGNCK, _head_major(v, chunk_size), jnp.cumsum(g_BGRNC, axis=-1),
                     _head_major(beta.astype(jnp.float32), chunk_size))


def _per_position(x_BNC):
  return x_BNC[:, None, None]  # [B, 1, 1, N, C] against [B, G, R, N, C]


def _forward(q, k, v, g, beta, seg_BS, state_BHKV, chunk_size, l2_normalize, t_BHNCC):
  """((o, final state), T): the chunks' T = (I + A)⁻¹ and U, W by `chunk_wy`'s kernel, or, given T (the backward),
  U and W from it by `wy_from_inverse` (differentiable)."""
  dtype = jnp.float32 if v.dtype == jnp.float32 else jnp.bfloat16
  x = _head_chunks(q, k, v, g, beta, chunk_size, l2_normalize, dtype)
  masks = gdc.chunk_masks(seg_BS, chunk_size)
  seg_BNC = gdc.to_chunks(seg_BS, chunk_size, mode="edge")
  heads = lambda x_BGR_: x_BGR_.reshape(x_BGR_.shape[0], -1, *x_BGR_.shape[3:])
  gamma_BHNC = heads(x.gamma_BGRNC)
  wy_inputs = (x.k_BGNCK, x.v_BHNCV, x.beta_BHNC, gamma_BHNC, masks.reads_BNC, seg_BNC)
  if t_BHNCC is None:
    t_BHNCC, u_BHNCV, w_BHNCK = _per_platform(lambda *a: chunk_wy(*a[:-1], dtype, a[-1]), *wy_inputs)
  else:
    u_BHNCV, w_BHNCK = wy_from_inverse(t_BHNCC, *wy_inputs, dtype)
  gamma_end_BGRN = x.gamma_BGRNC[..., -1]
  kd_BGRNCK = scaled(x.k_BGNCK, _per_position(masks.writes_BNC) * jnp.exp(gamma_end_BGRN[..., None]
                                                                           - x.gamma_BGRNC), dtype)
  decay_BHN = heads(masks.keeps_BN[:, None, None] * jnp.exp(gamma_end_BGRN))
  states_BHNKV, vnew_BHNCV, state_BHKV = _per_platform(
      lambda *a: state_pass(*a[:-1], dtype, a[-1]), heads(kd_BGRNCK), w_BHNCK, u_BHNCV, decay_BHN,
      state_BHKV)
  o_BSHV = _per_platform(lambda *a: chunk_output(*a[:-1], v.dtype, dtype, a[-1]), x.q_BGNCK, x.k_BGNCK, gamma_BHNC,
                         masks.reads_BNC, seg_BNC, states_BHNKV, vnew_BHNCV)
  return (o_BSHV[:, :v.shape[1]], state_BHKV), t_BHNCC


def kernel_chunked_forward(q, k, v, g, beta, seg_BS, state_BHKV, chunk_size, l2_normalize, keep_inverse):
  """The chunked form with the Pallas kernels (`gated_delta_kernels`): each chunk's T, U and W, the loop over chunks
  and each chunk's output as kernels, the decayed keys and decays XLA's, q and k at their key heads; operands
  bfloat16 unless v is float32. Returns (o [B, S, H, V] in v's dtype, final state float32).

  Its VJP keeps the inputs and, with `keep_inverse`, each chunk's T (C / V of v's size: the backward then skips the
  inverse, `chunk_wy`, the forward's costliest kernel); it reruns the rest of the forward for the per-chunk states
  and differentiates that."""
  if not takes_the_kernels(chunk_size):
    raise ValueError(f"chunk_size={chunk_size}: the Pallas kernels take a power of 2, at least {BLOCK}")
  return _kernel_chunked(q, k, v, g, beta, seg_BS, state_BHKV.astype(jnp.float32), chunk_size, l2_normalize,
                         keep_inverse)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _kernel_chunked(q, k, v, g, beta, seg_BS, state_BHKV, chunk_size, l2_normalize, keep_inverse):
  return _forward(q, k, v, g, beta, seg_BS, state_BHKV, chunk_size, l2_normalize, None)[0]


def _kernel_chunked_fwd(q, k, v, g, beta, seg_BS, state_BHKV, chunk_size, l2_normalize, keep_inverse):
  out, t_BHNCC = _forward(q, k, v, g, beta, seg_BS, state_BHKV, chunk_size, l2_normalize, None)
  return out, (q, k, v, g, beta, seg_BS, state_BHKV, t_BHNCC if keep_inverse else None)


def _kernel_chunked_bwd(chunk_size, l2_normalize, keep_inverse, residuals, cotangents):
  q, k, v, g, beta, seg_BS, state_BHKV, t_BHNCC = residuals
  if t_BHNCC is None:  # not kept: the forward's inverse again (the rest of that forward is dead code, dropped)
    t_BHNCC = _forward(q, k, v, g, beta, seg_BS, state_BHKV, chunk_size, l2_normalize, None)[1]
  forward = lambda q, k, v, g, beta, s: _forward(q, k, v, g, beta, seg_BS, s, chunk_size, l2_normalize, t_BHNCC)[0]
  _, vjp = jax.vjp(forward, q, k, v, g, beta, state_BHKV)
  dq, dk, dv, dg, dbeta, dstate = vjp(cotangents)
  return dq, dk, dv, dg, dbeta, None, dstate


_kernel_chunked.defvjp(_kernel_chunked_fwd, _kernel_chunked_bwd)
