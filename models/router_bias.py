"""Auxiliary-loss-free balancing's per-expert router bias (`Qwen3MoEConfig.router_bias_update_rate`): a model
variable that is state, not a parameter (no optimizer moves it, no gradient reaches it), and its update after each
training step from the step's load per expert (`rm.update_router_bias`)."""

import jax
from flax import nnx

import relaymoe_jax as rm
from models.qwen3_config import layer_groups

BIAS = "router_bias_E"  # the MoE module's attribute (stacked layers: [layers, E])


class RouterBias(nnx.Variable):
  """Per-expert bias added to the router's probabilities for the top-k choice (`rm.route`'s `bias_E`)."""


def has_router_bias(params):
  return any(_is_bias(path) for path, _ in jax.tree_util.tree_leaves_with_path(params))


def update_router_biases(params, previous, counts_YE, config, runtime):
  """`params` (the model's pure dict after the optimizer's update) with every router bias set to `previous`'s (the
  step's parameters) moved by `config.router_bias_update_rate` × sign(mean load − load): whatever the optimizer
  did to it is dropped. `counts_YE`: the step's pairs per expert of each MoE layer, in layer order."""
  sparse = [layer for layer in range(config.num_hidden_layers) if config.is_sparse(layer)]
  groups = layer_groups(config, runtime)

  def update(path, new, old):
    if not _is_bias(path):
      return new
    first, count = groups[path[1].key]
    start = sparse.index(first)
    counts = counts_YE[start:start + count] if old.ndim == 2 else counts_YE[start]
    return rm.update_router_bias(old, counts, config.router_bias_update_rate)

  return jax.tree_util.tree_map_with_path(update, params, previous)


def _is_bias(path):
  return getattr(path[-1], "key", None) == BIAS
