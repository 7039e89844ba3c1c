"""Gradient accumulation: one step's batch as A micro-batches in one compiled loop, gradients summed in float32,
with the loss, every gradient and the router losses those of the whole batch in one step.

The load-balancing loss is Hugging Face's over the whole batch, E · Σ_e f_e · P_e with f and P over every token
(and averaged over MoE layers), not a mean of per-micro-batch losses. P is a mean over tokens, so it splits over
micro-batches; f carries no gradient but weighs every micro-batch's dP, and is known only when every micro-batch
has been routed. So when that loss counts (a non-zero coefficient), a forward pass over the micro-batches first
counts the whole batch's routed pairs (one forward more per step); each micro-batch's backward then uses that f.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from train.data.batches import next_token_inputs


def micro_batches_of(tokens_BS1, micro_batches):
  """[A, B/A, S+1]: micro-batch a takes rows a, A + a, 2A + a, ...; each device's rows hold an equal share of every
  micro-batch, so no row moves between devices."""
  b = tokens_BS1.shape[0]
  return tokens_BS1.reshape(b // micro_batches, micro_batches, -1).swapaxes(0, 1)


def whole_batch_fraction(params, graphdef, batch_A, model_config):
  """f_e of the whole batch averaged over the MoE layers, [E] float32, from a forward pass over each micro-batch
  (the same forward as the training pass's, whose loss head goes unused). `batch_A`: the micro-batches' arrays."""

  def count(total_YE, batch):
    model = nnx.merge(graphdef, nnx.State(params))
    inputs_BS, labels_BS, documents = next_token_inputs(batch)
    _, aux = model.mean_cross_entropy_and_aux(inputs_BS, labels_BS, **documents)
    return total_YE + aux["moe"].router.expert_counts_E, None

  sparse = sum(model_config.is_sparse(i) for i in range(model_config.num_hidden_layers))
  total_YE, _ = jax.lax.scan(count, jnp.zeros((sparse, model_config.num_experts), jnp.int32), batch_A)
  a, b, s1 = batch_A["tokens"].shape
  return jnp.sum(total_YE, axis=0).astype(jnp.float32) / (sparse * a * b * (s1 - 1))


def _cross_entropy_weights(batch_A, micro_batches):
  """[A] float32: each micro-batch's share of the whole batch's counted targets, times A, so that the mean over
  micro-batches of their weighted cross-entropies is the whole batch's (`train.data.batches.documents` drops the targets
  that cross a document, and micro-batches hold different counts); None without documents (every share is 1)."""
  if "segment_ids" not in batch_A:
    return None
  counted_A = jax.vmap(lambda batch: jnp.sum(next_token_inputs(batch)[2]["weights_BS"].astype(jnp.float32)))(batch_A)
  return micro_batches * counted_A / jnp.maximum(jnp.sum(counted_A), 1.0)


def accumulated_value_and_grad(loss_fn, params, graphdef, batch, model_config, micro_batches,
                               param_shardings=None):
  """((loss, parts), grads) of the whole batch, as `jax.value_and_grad(loss_fn, has_aux=True)` gives them for it
  in one step (`train.step.loss_fn`), from `micro_batches` equal micro-batches. `parts["moe"]` holds the whole
  batch's per-layer routing: pairs and dropped pairs summed, means (probabilities, entropy, z-loss) averaged.
  `param_shardings`: where the float32 gradient sums live (default: XLA's choice)."""
  batch_A = {key: micro_batches_of(a, micro_batches) for key, a in batch.items()}
  has_moe = any(model_config.is_sparse(i) for i in range(model_config.num_hidden_layers))
  fraction_E = None
  if has_moe:
    fraction_E = (whole_batch_fraction(params, graphdef, batch_A, model_config)
                  if model_config.router_aux_loss_coef else jnp.zeros((model_config.num_experts,), jnp.float32))
  value_and_grad = jax.value_and_grad(loss_fn, has_aux=True)
  ce_weight_A = _cross_entropy_weights(batch_A, micro_batches)

  def one(carry, batch_and_weight):
    batch, ce_weight = batch_and_weight
    (loss, parts), grads = value_and_grad(params, graphdef, batch, model_config, fraction_E, ce_weight)
    grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
    return jax.tree.map(jnp.add, carry, ((loss, parts), grads)), None

  zeros = jax.eval_shape(lambda: value_and_grad(params, graphdef, {k: a[0] for k, a in batch_A.items()},
                                                model_config, fraction_E,
                                                None if ce_weight_A is None else ce_weight_A[0]))
  zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32 if jnp.issubdtype(x.dtype, jnp.floating)
                                           else x.dtype), zeros)
  if param_shardings is not None:
    zeros = (zeros[0], jax.tree.map(jax.lax.with_sharding_constraint, zeros[1], param_shardings))
  ((loss, parts), grads), _ = jax.lax.scan(one, zeros, (batch_A, ce_weight_A))
  grads = jax.tree.map(lambda g, p: (g / micro_batches).astype(p.dtype), grads, params)
  mean = micro_batches
  loss, parts = loss / mean, {k: v / mean for k, v in parts.items() if k != "moe"} | {"moe": parts["moe"]}
  if has_moe:
    moe = parts["moe"]
    router = moe.router._replace(
        fraction_E=moe.router.expert_counts_E.astype(jnp.float32) / batch_A["tokens"][0, :, 1:].size / mean,
        mean_prob_E=moe.router.mean_prob_E / mean, z_loss=moe.router.z_loss / mean,
        entropy=moe.router.entropy / mean)
    router = router._replace(load_balancing_loss=router.fraction_E.shape[-1] * jnp.sum(
        router.fraction_E * router.mean_prob_E, axis=-1))
    parts["moe"] = moe._replace(router=router)
    # The whole batch's loss from what its routing was in this pass (the counting pass's f gave the gradient).
    fraction_E = jnp.mean(router.fraction_E, axis=0)
    parts["load_balancing_loss"] = fraction_E.shape[0] * jnp.sum(fraction_E * jnp.mean(router.mean_prob_E, axis=0))
  return (loss, parts), grads
