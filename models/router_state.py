"""What a model's routing holds and reports beyond the router weights: auxiliary-loss-free balancing's per-expert
bias (`Qwen3MoEConfig.router_bias_update_rate`), a model variable that is state, not a parameter (no optimizer moves
it, no gradient reaches it), and its update after each training step from the step's load per expert
(`rm.update_router_bias`); and the router losses and per-layer statistics of a forward pass."""

import jax
import jax.numpy as jnp
from flax import nnx

import relaymoe_jax as rm

BIAS = "router_bias_E"  # the MoE module's attribute (stacked layers: [layers, E])


class RouterBias(nnx.Variable):
  """Per-expert bias added to the router's probabilities for the top-k choice (`rm.route`'s `bias_E`)."""


def router_bias(config, mesh):
  """A MoE layer's bias, zeros [E] replicated on `mesh`; None where the rate is 0 (the layer has none)."""
  if not config.router_bias_update_rate:
    return None
  return RouterBias(jnp.zeros((config.num_experts,), jnp.float32), out_sharding=(None,), mesh=mesh)


def bias_value(bias):
  return None if bias is None else bias[...]


def router_losses(auxes):
  """A model's router losses from its MoE layers' `rm.MoEAux`es, in layer order: Hugging Face's load-balancing loss
  over every layer's routing (`rm.load_balancing_loss`) and the mean z-loss, scalars, and under "moe" the auxes
  stacked over layers (arrays [Y, ...]; absent without MoE layers, where the losses are 0)."""
  if not auxes:
    return {"load_balancing_loss": jnp.float32(0.0), "router_z_loss": jnp.float32(0.0)}
  return {"load_balancing_loss": rm.load_balancing_loss([a.router for a in auxes]),
          "router_z_loss": sum(a.router.z_loss for a in auxes) / len(auxes),
          "moe": jax.tree.map(lambda *layers: jnp.stack(layers), *auxes)}


def update_router_biases(params, previous, counts_YE, config, runtime):
  """`params` (the model's pure dict after the optimizer's update) with every router bias set to `previous`'s (the
  step's parameters) moved by `config.router_bias_update_rate` × sign(mean load − load): whatever the optimizer
  did to it is dropped. `counts_YE`: the step's pairs per expert of each MoE layer, in layer order."""
  sparse = [layer for layer in range(config.num_hidden_layers) if config.is_sparse(layer)]
  groups = config.layer_groups(runtime)

  def update(path, new, old):
    if not _is_bias(path):
      return new
    group = groups[path[1].key]
    offset = path[4].key if group.period > 1 else 0  # [layers, g, stacked, layers, offset, ...] in a block
    rows = jnp.array([sparse.index(layer) for layer in group.layers(offset)])
    counts = counts_YE[rows] if old.ndim == 2 else counts_YE[rows[0]]
    return rm.update_router_bias(old, counts, config.router_bias_update_rate)

  return jax.tree_util.tree_map_with_path(update, params, previous)


def non_finite_biases(params):
  """How many router-bias entries of `params` (a pure dict) are not finite, an int32 scalar (0 without a bias)."""
  biases = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(params) if _is_bias(path)]
  return sum((jnp.sum(~jnp.isfinite(b), dtype=jnp.int32) for b in biases), jnp.int32(0))


def _is_bias(path):
  return getattr(path[-1], "key", None) == BIAS
