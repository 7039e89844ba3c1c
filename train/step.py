"""The optimizer, the loss and the one jitted `train_step(state, batch) -> (state, metrics)`; model FLOPs."""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import relaymoe_jax as rm
from models import families
from models.qwen3 import model as qwen3
from models.router_state import non_finite_biases, update_router_biases
from train.accumulate import accumulated_value_and_grad
from train.data.batches import next_token_inputs


class TrainState(NamedTuple):
  params: dict  # pure dict of arrays (nnx.to_pure_dict of the model's Params)
  opt_state: optax.OptState
  step: jax.Array


def abstract_train_state(model_config, runtime, mesh, optimizer, seed=0):
  """(graphdef, the TrainState as ShapeDtypeStructs with the shardings `run` gives the real one): nothing is
  allocated. Optimizer moments take their parameter's sharding (as the eager init does), counters replicate."""
  graphdef, state = families.abstract(model_config, mesh, seed, runtime=runtime)
  params = nnx.to_pure_dict(state)
  param_shardings = {jax.tree_util.keystr(path): p.sharding for path, p in jax.tree_util.tree_leaves_with_path(params)}
  replicated = NamedSharding(mesh, P())

  def like_its_parameter(path, leaf):
    key = jax.tree_util.keystr(path)
    owner = max((p for p in param_shardings if key.endswith(p)), key=len, default=None)
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=param_shardings[owner] if owner else replicated)

  opt_state = jax.tree_util.tree_map_with_path(like_its_parameter, jax.eval_shape(optimizer.init, params))
  return graphdef, TrainState(params, opt_state, jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated))


def decay_mask(params):
  """True for the parameters that get weight decay: a layer's matrices, not its norms or biases (whose stacked
  form under `scan_layers` is a matrix too)."""
  return jax.tree_util.tree_map_with_path(lambda path, p: qwen3.per_layer_ndim(path, p) >= 2, params)


def make_optimizer(optim, total_steps):
  """AdamW with weight decay on matrices only (`decay_mask`), linear warmup + cosine decay, global-norm
  clipping. Returns (optimizer, schedule); the schedule is shifted by one so that step 0 already learns."""
  warmup_cosine = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=optim.learning_rate, warmup_steps=max(optim.warmup_steps, 1),
      decay_steps=max(total_steps, optim.warmup_steps + 1), end_value=optim.learning_rate * optim.min_lr_ratio)

  def schedule(step):
    return warmup_cosine(step + 1)

  return optax.chain(
      optax.clip_by_global_norm(optim.grad_clip),
      optax.adamw(schedule, b1=optim.b1, b2=optim.b2, eps=optim.eps, weight_decay=optim.weight_decay,
                  mask=decay_mask),
  ), schedule


def loss_fn(params, graphdef, batch, model_config, fraction_E=None, ce_weight=None):
  """Next-token cross-entropy (float32, chunked: the full logits never exist; its gradient computed in the forward)
  over the targets in their input's document (`batch`: `train.data.batches.documents`), plus the router losses, as
  configured; parts: ce, the router losses and "moe" (every MoE layer's `rm.MoEAux`,
  stacked; None without MoE layers). `fraction_E`: for one micro-batch of several (`train.accumulate`), the whole
  batch's f_e (averaged over MoE layers), which the load-balancing loss then takes with this micro-batch's P_e;
  `ce_weight` scales its cross-entropy (its share of the whole batch's counted targets, times the micro-batches)."""
  model = nnx.merge(graphdef, nnx.State(params))
  inputs_BS, labels_BS, documents = next_token_inputs(batch)
  ce, aux = model.mean_cross_entropy_and_aux(inputs_BS, labels_BS, **documents)
  ce = ce if ce_weight is None else ce * ce_weight
  balance = aux["load_balancing_loss"]
  if fraction_E is not None:
    balance = fraction_E.shape[0] * jnp.sum(fraction_E * jnp.mean(aux["moe"].router.mean_prob_E, axis=0))
  loss = (ce + model_config.router_aux_loss_coef * balance
          + model_config.router_z_loss_coef * aux["router_z_loss"])
  return loss, dict(ce=ce, load_balancing_loss=balance, router_z_loss=aux["router_z_loss"], moe=aux.get("moe"))


BAD_IDS = "token_ids_out_of_range"  # a metric the loop checks and does not log
BAD_BIAS = "router_bias_not_finite"  # the same: router-bias entries that are not finite after the step
# The load statistics (per MoE layer) that a non-finite router makes non-finite.
NON_FINITE_LOAD = ("expert_load_max", "expert_load_min", "expert_load_cv", "router_entropy")


def non_finite_state(values):
  """What of a step's metrics on the host (`values`, `BAD_BIAS` popped) is not finite, a phrase; "" when all is:
  the loss, the norms, a router bias, or a load statistic (a NaN bias leaves the loss finite while it kills experts)."""
  bias = int(values.pop(BAD_BIAS, 0))
  bad = [f"{k} {values[k]}" for k in NON_FINITE_LOAD if not all(math.isfinite(x) for x in values.get(k, ()))]
  bad += [f"{bias} router-bias entries not finite"] if bias else []
  if all(math.isfinite(values[k]) for k in ("loss", "grad_norm", "update_norm")) and not bad:
    return ""
  return ", ".join([f"loss {values['loss']}, gradient norm {values['grad_norm']}, update norm {values['update_norm']}",
                    *bad])


def bad_token_ids(tokens_BS1, model_config):
  """How many ids of the batch are not in the vocabulary: the data's ids are checked once at the start, so these
  come from a file changed under the run (the loss of a label outside the vocabulary is garbage, not an error)."""
  return jnp.sum((tokens_BS1 < 0) | (tokens_BS1 >= model_config.vocab_size))


def expert_load_metrics(moe):
  """Per MoE layer (lists over Y): tokens per expert as max/mean, min/mean and coefficient of variation, experts
  that got no token, the router's entropy (nats), pairs a capacity factor dropped; and `expert_tokens` [Y, E]."""
  if moe is None:
    return {}
  counts_YE = moe.router.expert_counts_E
  stats = rm.expert_load_stats(counts_YE)
  return dict(expert_load_max=stats["max_over_mean"], expert_load_min=stats["min_over_mean"],
              expert_load_cv=stats["cv"], dead_experts=stats["dead"], router_entropy=moe.router.entropy,
              dropped_pairs=moe.dropped_pairs, expert_tokens=counts_YE)


def make_train_step(graphdef, optimizer, schedule, model_config, runtime=None, micro_batches=1,
                    param_shardings=None):
  """train_step(state, batch) -> (state, metrics) (`batch`: `train.data.batches.documents`); jit it with the state donated.
  `micro_batches` > 1: gradient accumulation (`train.accumulate`; `param_shardings` place its float32 sums).
  `runtime`: the model's (needed with a router bias, `router_bias_update_rate`, to find each layer's bias)."""

  def train_step(state, batch):
    if micro_batches == 1:
      (loss, parts), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, graphdef, batch, model_config)
    else:
      (loss, parts), grads = accumulated_value_and_grad(loss_fn, state.params, graphdef, batch, model_config,
                                                        micro_batches, param_shardings)
    with jax.named_scope("optimizer"):  # the step profile's part (`train.profile.step_parts`)
      updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
      params = optax.apply_updates(state.params, updates)
      moe = parts.pop("moe")
      if model_config.router_bias_update_rate:
        params = update_router_biases(params, state.params, moe.router.expert_counts_E, model_config, runtime)
      metrics = dict(loss=loss, grad_norm=optax.tree.norm(grads), update_norm=optax.tree.norm(updates),
                     learning_rate=schedule(state.step), **parts, **expert_load_metrics(moe))
      if model_config.router_bias_update_rate:
        metrics[BAD_BIAS] = non_finite_biases(params)
    metrics[BAD_IDS] = bad_token_ids(batch["tokens"], model_config)
    return TrainState(params, opt_state, state.step + 1), metrics

  return train_step


def layer_forward_flops(c, seq_len, layer):
  """(attention, MLP) forward FLOPs per token of one layer: matmuls, and causal attention scores; the MLP is the
  router and top-k experts (plus the shared expert) on MoE layers, the dense SwiGLU elsewhere."""
  attn_dims = c.num_attention_heads * c.head_dim
  kv_dims = c.num_key_value_heads * c.head_dim
  gated = hasattr(c, "layer_types")  # Qwen3.5: q_proj also gives the attention's output gate
  attention = 2 * c.hidden_size * ((2 + gated) * attn_dims + 2 * kv_dims) + score_flops(c, seq_len)
  if gated and c.is_linear(layer):
    attention = delta_flops(c)
  if c.is_sparse(layer):
    shared_gate = 2 * c.hidden_size if c.shared_expert_intermediate_size else 0
    return attention, (2 * c.hidden_size * c.num_experts + c.num_experts_per_tok * 6 * c.hidden_size
                       * c.moe_intermediate_size + 6 * c.hidden_size * c.shared_expert_intermediate_size + shared_gate)
  return attention, 6 * c.hidden_size * c.intermediate_size


def mean_layer_flops(c, seq_len):
  """(attention, MLP, attention-kernel scores) forward FLOPs per token, each the mean over the layers: what the
  planner prices recompute with. A DeltaNet layer has no attention kernel, so none of its work is scores."""
  layers = range(c.num_hidden_layers)
  attention, mlp = (sum(f) / c.num_hidden_layers for f in zip(*(layer_forward_flops(c, seq_len, i) for i in layers)))
  linear = getattr(c, "is_linear", lambda layer: False)
  scores = sum(score_flops(c, seq_len) for i in layers if not linear(i)) / c.num_hidden_layers
  return attention, mlp, scores


def delta_flops(c):
  """A Gated DeltaNet layer's forward FLOPs per token, as Megatron counts them: its projections (q, k, v, z, β, a
  in; out), the conv, and 8 · heads · key width · value width for the delta rule's core."""
  keys, values = c.linear_num_key_heads * c.linear_key_head_dim, c.linear_num_value_heads * c.linear_value_head_dim
  projections = 2 * c.hidden_size * (2 * keys + 2 * values + 2 * c.linear_num_value_heads) + 2 * values * c.hidden_size
  conv = 2 * c.linear_conv_kernel_dim * (2 * keys + values)
  return projections + conv + 8 * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim


def score_flops(c, seq_len):
  """Causal attention's forward FLOPs per token of one layer (scores and their weighted sum over half a sequence on
  average): what the attention kernel computes."""
  return 2 * seq_len * c.num_attention_heads * c.head_dim


def model_flops_per_token(c, seq_len):
  """Training FLOPs per token (3 × forward: matmuls and causal attention scores), without recompute."""
  layers = sum(sum(layer_forward_flops(c, seq_len, i)) for i in range(c.num_hidden_layers))
  return 3 * (layers + 2 * c.hidden_size * c.vocab_size)
