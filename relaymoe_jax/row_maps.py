"""Row moves whose backward is a gather too: the all-to-all's dispatch and combine without scatter-adds.

Plain autodiff transposes a row gather into a scatter-add (float32 atomics on GPUs, where the all-to-all's
routing, slot packing and combine spent most of its time). Each move here takes, beside the rows, the inverse map
that its transpose needs, computed once in the forward from the int32 routing and kept for the backward:

  expand:   slot s ← token tok_S[s] (each token in up to K slots);  backward: token t ← Σ_k slot slot_TK[t, k]
  permute:  row m ← row order_M[m] (a permutation);                 backward: row m ← row inverse_M[m]
  combine:  token t ← Σ_k w_TK[t, k] · slot slot_TK[t, k];          backward: slot s ← w_S[s] · token tok_S[s]

A slot that holds no pair (`valid_S` false), or a pair that has no slot (`kept_TK` false: dropped by a capacity),
reads and writes zeros. Integer arguments get no cotangent. Shape letters: see relaymoe_jax; S slots.
"""

import functools

import jax
import jax.numpy as jnp


def _rows(x_AD, index_B, valid_B):
  return jnp.where(valid_B[:, None], x_AD[index_B], jnp.zeros((), x_AD.dtype))


def _sum_over_k(x_SD, slot_TK, kept_TK):
  """[T, D] float32: Σ_k x[slot_TK[t, k]] over the kept pairs."""
  picked_TKD = jnp.where(kept_TK[..., None], x_SD[slot_TK].astype(jnp.float32), 0.0)
  return picked_TKD.sum(1)


@jax.custom_vjp
def expand(x_TD, tok_S, valid_S, slot_TK, kept_TK):
  """[S, D]: each slot's token row (zeros where not valid)."""
  return _rows(x_TD, tok_S, valid_S)


def _expand_fwd(x_TD, tok_S, valid_S, slot_TK, kept_TK):
  return expand(x_TD, tok_S, valid_S, slot_TK, kept_TK), (slot_TK, kept_TK)


def _expand_bwd(residuals, dy_SD):
  slot_TK, kept_TK = residuals
  return _sum_over_k(dy_SD, slot_TK, kept_TK).astype(dy_SD.dtype), None, None, None, None


expand.defvjp(_expand_fwd, _expand_bwd)


@jax.custom_vjp
def permute(x_MD, order_M, inverse_M):
  """x[order_M], where `inverse_M` is the inverse permutation."""
  return x_MD[order_M]


def _permute_fwd(x_MD, order_M, inverse_M):
  return x_MD[order_M], (order_M, inverse_M)


def _permute_bwd(residuals, dy_MD):
  _, inverse_M = residuals
  return dy_MD[inverse_M], None, None


permute.defvjp(_permute_fwd, _permute_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def combine(y_SD, w_TK, slot_TK, kept_TK, tok_S, valid_S, out_dtype, sum_partials):
  """[T, D] in `out_dtype`: Σ_k w_TK · y[slot_TK] over the kept pairs, in float32. `sum_partials`: where y holds
  partial sums (expert tensor parallelism: a slice of F each), their sum over the devices; the router weights'
  gradient needs it, which plain autodiff would have placed."""
  picked_TKD = jnp.where(kept_TK[..., None], y_SD[slot_TK].astype(jnp.float32), 0.0)
  return jnp.einsum("tkd,tk->td", picked_TKD, w_TK.astype(jnp.float32)).astype(out_dtype)


def _combine_fwd(y_SD, w_TK, slot_TK, kept_TK, tok_S, valid_S, out_dtype, sum_partials):
  out = combine(y_SD, w_TK, slot_TK, kept_TK, tok_S, valid_S, out_dtype, sum_partials)
  return out, (y_SD, w_TK, slot_TK, kept_TK, tok_S, valid_S)


def _combine_bwd(out_dtype, sum_partials, residuals, dy_TD):
  y_SD, w_TK, slot_TK, kept_TK, tok_S, valid_S = residuals
  dy_TD = dy_TD.astype(jnp.float32)
  # Each valid slot holds one pair (t, k): its weight, read back through the same map.
  w_S = jnp.zeros(y_SD.shape[:1], jnp.float32).at[jnp.where(kept_TK, slot_TK, y_SD.shape[0])].set(
      w_TK.astype(jnp.float32), mode="drop")
  dy_SD = (_rows(dy_TD, tok_S, valid_S) * w_S[:, None]).astype(y_SD.dtype)
  picked_TKD = jnp.where(kept_TK[..., None], y_SD[slot_TK].astype(jnp.float32), 0.0)
  dw_TK = sum_partials(jnp.einsum("tkd,td->tk", picked_TKD, dy_TD)).astype(w_TK.dtype)
  return dy_SD, dw_TK, None, None, None, None


combine.defvjp(_combine_fwd, _combine_bwd)
