"""Qwen3 router: softmax over all experts in float32, top-k, optional renormalisation.

No communication of its own: it runs on global arrays and XLA partitions it along the token sharding. Shape
letters: see relaymoe_jax.
"""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from relaymoe_jax.errors import UserError
from relaymoe_jax.kernels.grouped_matmul import matmul_precision


class RouterAux(NamedTuple):
  """Router statistics for the training losses and logs.

  Attributes:
    load_balancing_loss: E · Σ_e f_e · P_e with f_e = (pairs routed to e) / T and P_e the mean router probability
      of e, exactly as Hugging Face's Qwen3-MoE `load_balancing_loss_func` computes it for one layer (K under
      uniform routing). For several layers use `load_balancing_loss(auxes)`, as Hugging Face does.
    expert_counts_E: int32 number of token–expert pairs routed to each expert.
    z_loss: mean over tokens of logsumexp(logits)², the router z-loss of ST-MoE.
    fraction_E: f_e, float32.
    mean_prob_E: P_e, float32.
    entropy: mean over tokens of the router distribution's entropy, −Σ_e p_e ln p_e (nats; ln E when uniform).
  """

  load_balancing_loss: jax.Array
  expert_counts_E: jax.Array
  z_loss: jax.Array
  fraction_E: jax.Array
  mean_prob_E: jax.Array
  entropy: jax.Array


def load_balancing_loss(auxes):
  """Hugging Face's load-balancing loss over several MoE layers: it concatenates every layer's router logits, so
  f_e and P_e are averaged over all (layer, token) rows before the product: E · Σ_e mean_l(f_le) · mean_l(P_le)
  (layers see the same tokens). Not the mean of the per-layer losses, which differs when layers route differently.

  Args:
    auxes: `RouterAux`es, or one: each of one layer (fraction_E [E]) or of stacked layers (fraction_E [L, E], as
      `nn.scan` / `nnx.scan` stack what a scanned layer sows or returns).

  Raises:
    ValueError: an aux whose fraction_E or mean_prob_E is not [E] or [L, E], or auxes of different E.
  """
  auxes = [auxes] if isinstance(auxes, RouterAux) else list(auxes)
  if not auxes:
    raise UserError("load_balancing_loss needs at least one RouterAux")
  shapes = [(tuple(a.fraction_E.shape), tuple(a.mean_prob_E.shape)) for a in auxes]
  num_experts = shapes[0][0][-1] if shapes[0][0] else None
  for i, (fraction, prob) in enumerate(shapes):
    if fraction != prob or len(fraction) not in (1, 2) or fraction[-1] != num_experts:
      raise UserError(f"auxes[{i}]: fraction_E {fraction} and mean_prob_E {prob} must both be [E] (one layer) or "
                       f"[L, E] (stacked layers) with E={num_experts} as in auxes[0]")
  fraction_LE = jnp.concatenate([a.fraction_E.reshape(-1, num_experts) for a in auxes])
  prob_LE = jnp.concatenate([a.mean_prob_E.reshape(-1, num_experts) for a in auxes])
  return num_experts * jnp.sum(jnp.mean(fraction_LE, 0) * jnp.mean(prob_LE, 0))


def route(x_TD, router_DE, *, top_k, norm_topk_prob=True, bias_E=None):
  """Chooses top_k experts per token.

  Zero tokens give empty routing and zero statistics and losses (a layer that saw no tokens adds nothing to a
  loss), not the NaN of a mean over nothing.

  Args:
    x_TD: tokens [..., D] (any leading dims: [T, D], [B, S, D]), any floating dtype.
    router_DE: router weight (no bias).
    top_k: experts per token, 1 ≤ top_k ≤ E.
    norm_topk_prob: renormalise the k probabilities to sum to one (Qwen3 default).
    bias_E: float32 per-expert bias added to the probabilities for the choice of experts only (auxiliary-loss-free
      balancing, DeepSeek-V3); the weights stay the unbiased probabilities, and no gradient reaches the bias.

  Returns:
    (idx_TK int32 expert ids [..., K], w_TK router weights [..., K] in x's dtype, RouterAux over every token).
  """
  if x_TD.ndim < 1 or router_DE.ndim != 2 or x_TD.shape[-1] != router_DE.shape[0] or not x_TD.shape[-1]:
    raise UserError(f"route expects x_TD [..., D] and router_DE [D, E], D ≥ 1; got {x_TD.shape} and "
                    f"{router_DE.shape}")
  if not jnp.issubdtype(x_TD.dtype, jnp.floating):
    raise UserError(f"route expects floating-point x_TD; got dtype {x_TD.dtype}")
  num_experts = router_DE.shape[1]
  if not 1 <= top_k <= num_experts:
    raise UserError(f"top_k={top_k} must be between 1 and the number of experts E={num_experts}")
  logits_TE = jnp.dot(x_TD, router_DE.astype(x_TD.dtype), preferred_element_type=jnp.float32,
                      precision=matmul_precision(x_TD.dtype))
  probs_TE = jax.nn.softmax(logits_TE, axis=-1)
  if bias_E is None:
    w_TK, idx_TK = jax.lax.top_k(probs_TE, top_k)
  else:
    _, idx_TK = jax.lax.top_k(jax.lax.stop_gradient(probs_TE + bias_E), top_k)
    w_TK = jnp.take_along_axis(probs_TE, idx_TK, axis=-1)
  if norm_topk_prob:
    w_TK = w_TK / jnp.sum(w_TK, axis=-1, keepdims=True)
  lead = tuple(range(x_TD.ndim - 1))
  counts_E = jnp.sum(jax.nn.one_hot(idx_TK, num_experts, dtype=jnp.int32), axis=(*lead, x_TD.ndim - 1))
  tokens = max(math.prod(x_TD.shape[:-1]), 1)  # means over tokens: 0 over none
  fraction_E = counts_E.astype(jnp.float32) / tokens
  mean_prob_E = jnp.sum(probs_TE, axis=lead) / tokens
  aux = RouterAux(
      load_balancing_loss=num_experts * jnp.sum(fraction_E * mean_prob_E),
      expert_counts_E=counts_E,
      z_loss=jnp.sum(jax.nn.logsumexp(logits_TE, axis=-1) ** 2) / tokens,
      fraction_E=fraction_E,
      mean_prob_E=mean_prob_E,
      entropy=jnp.sum(jax.nn.logsumexp(logits_TE, axis=-1) - jnp.sum(probs_TE * logits_TE, axis=-1)) / tokens,
  )
  return idx_TK.astype(jnp.int32), w_TK.astype(x_TD.dtype), aux
