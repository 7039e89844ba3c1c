"""The gated delta rule's chunked form: the building blocks its XLA form (`gated_delta`) and its kernel path
(`gated_delta_kernels`) share: the inputs checked, q and k normalised, sequences cut into chunks, the documents'
masks and the decays between chunk positions, and (I + A)⁻¹ in XLA. The math: `gated_delta`'s docstring.

Shape letters: see relaymoe_jax (the gated delta rule's own).
"""

import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from relaymoe_jax.errors import UserError

# Matching float32 references needs full float32 matmuls; DEFAULT precision may use TF32 on GPUs.
PRECISION = lax.Precision.HIGHEST


def einsum(spec, *operands):
  """`jnp.einsum` at full float32 precision."""
  return jnp.einsum(spec, *operands, precision=PRECISION)


def check_inputs(q, k, v, g, beta, segment_ids, initial_state, chunk_size):
  """Refuses, naming the value, inputs whose shapes do not fit together (a shorter β or segment_ids would otherwise
  be padded silently, a wrong g fail deep inside)."""
  if not (isinstance(chunk_size, numbers.Integral) and chunk_size > 0):
    raise UserError(f"chunk_size={chunk_size!r} must be a positive integer")
  for name, x in (("q", q), ("k", k), ("v", v)):
    if x.ndim != 4:
      raise UserError(f"{name} has shape {x.shape}; the rule takes [B, S, heads, head_dim]")
  if q.shape != k.shape:
    raise UserError(f"q {q.shape} and k {k.shape} differ; both are [B, S, Hk, K]")
  batch, seq_len, num_v_heads, value_dim = v.shape
  if q.shape[:2] != (batch, seq_len):
    raise UserError(f"q and k {q.shape} and v {v.shape} differ in [B, S]")
  if num_v_heads % k.shape[2]:
    raise UserError(f"{num_v_heads} value heads are not a multiple of {k.shape[2]} key heads")
  per_head = (batch, seq_len, num_v_heads)
  expected = {"g": (g, per_head), "beta": (beta, per_head),
              "segment_ids": (segment_ids, (batch, seq_len)),
              "initial_state": (initial_state, (batch, num_v_heads, k.shape[3], value_dim))}
  for name, (x, shape) in expected.items():
    if x is not None and tuple(jnp.shape(x)) != shape:
      raise UserError(f"{name} has shape {tuple(jnp.shape(x))}; with q, k {q.shape} and v {v.shape} it must be "
                      f"{shape}")


def l2_scale(x_BSHK):
  """r [B, S, H] such that x r is x's L2 normalisation over its last axis (float32 x)."""
  return lax.rsqrt(jnp.sum(x_BSHK * x_BSHK, axis=-1) + 1e-6)


def _l2_normalize(x_BSHK):
  return x_BSHK * l2_scale(x_BSHK)[..., None]


def normalize_qk(q_BSGK, k_BSGK, l2_normalize):
  """float32, optional L2 norm, q scaled by K^-1/2."""
  q_BSGK, k_BSGK = q_BSGK.astype(jnp.float32), k_BSGK.astype(jnp.float32)
  if l2_normalize:
    q_BSGK, k_BSGK = _l2_normalize(q_BSGK), _l2_normalize(k_BSGK)
  return q_BSGK * q_BSGK.shape[-1] ** -0.5, k_BSGK


def prepare_qk(q_BSGK, k_BSGK, num_v_heads, l2_normalize):
  """`normalize_qk`, key heads repeated to value heads."""
  q_BSGK, k_BSGK = normalize_qk(q_BSGK, k_BSGK, l2_normalize)
  repeats = num_v_heads // k_BSGK.shape[2]
  return jnp.repeat(q_BSGK, repeats, axis=2), jnp.repeat(k_BSGK, repeats, axis=2)


def segment_ids(segment_ids_BS, batch, seq_len):
  return jnp.zeros((batch, seq_len), jnp.int32) if segment_ids_BS is None else jnp.asarray(segment_ids_BS)


def to_chunks(x_BS, chunk_size, mode="constant"):
  """[B, S, ...] → [B, N, C, ...], right-padding S to a multiple of C."""
  pad = -x_BS.shape[1] % chunk_size
  x_BS = jnp.pad(x_BS, [(0, 0), (0, pad)] + [(0, 0)] * (x_BS.ndim - 2), mode=mode)
  return x_BS.reshape(x_BS.shape[0], -1, chunk_size, *x_BS.shape[2:])


def diagonal_blocks(x_XCC, size):
  """[..., C, C] → [..., C / size, size, size], the blocks on the diagonal."""
  n = x_XCC.shape[-1] // size
  x_XnsNs = x_XCC.reshape(x_XCC.shape[:-2] + (n, size, n, size))
  return jnp.moveaxis(jnp.diagonal(x_XnsNs, axis1=-4, axis2=-2), -1, -3)


def unit_lower_inverse(a_XCC):
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
    a21_XNss = diagonal_blocks(a_XPP, 2 * size)[..., size:, :size]
    t21_XNss = -einsum("...ij,...jk,...kl->...il", t2_XNss, a21_XNss, t1_XNss)
    inv_XNss = jnp.concatenate([
        jnp.concatenate([t1_XNss, jnp.zeros_like(t1_XNss)], axis=-1),
        jnp.concatenate([t21_XNss, t2_XNss], axis=-1),
    ], axis=-2)
    size *= 2
  return inv_XNss[..., 0, :c, :c]


class Masks(NamedTuple):
  """Where documents let chunk positions see each other and the state, as float32 0/1."""
  sees_BNCC: jax.Array  # s ≤ r in the same document
  reads_BNC: jax.Array  # m: position r lies in the incoming state's document
  writes_BNC: jax.Array  # e: position s lies in the chunk's last document
  keeps_BN: jax.Array  # c: the chunk's last document is the incoming state's


def sees(seg_BNC, diagonal=True):
  """[B, N, C, C]: s ≤ r (s < r without the diagonal) in the same document, from the chunks' segment ids."""
  c = seg_BNC.shape[-1]
  lower_CC = jnp.tril(jnp.ones((c, c), bool), 0 if diagonal else -1)
  return (seg_BNC[..., :, None] == seg_BNC[..., None, :]) & lower_CC


def chunk_masks(seg_BS, chunk_size):
  # Padding joins the last document, so with g = β = 0 it leaves that document's state intact.
  seg_BNC = to_chunks(seg_BS, chunk_size, mode="edge")
  seg_in_BN = jnp.concatenate([seg_BNC[:, :1, 0], seg_BNC[:, :-1, -1]], axis=1)
  return Masks(sees_BNCC=sees(seg_BNC),
                reads_BNC=(seg_BNC == seg_in_BN[..., None]).astype(jnp.float32),
                writes_BNC=(seg_BNC == seg_BNC[..., -1:]).astype(jnp.float32),
                keeps_BN=(seg_BNC[..., -1] == seg_in_BN).astype(jnp.float32))


def decays(gamma_XC, sees_XCC):
  """exp(Γ_r − Γ_s) where s sees r, else 0; masking before exp keeps exp(positive) overflow out of both the values
  and the gradients."""
  diff_XCC = gamma_XC[..., :, None] - gamma_XC[..., None, :]
  return jnp.where(sees_XCC, jnp.exp(jnp.where(sees_XCC, diff_XCC, 0.0)), 0.0)
