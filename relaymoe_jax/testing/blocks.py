"""The layer and whole-block forms of the oracle check: a Flax layer, or any block of yours (an Equinox module, a
function over your weights, a `shard_map` around it), against itself with every `moe_ffn` in it run by the dense
oracle in float32. No communication of its own (`moe_ffn`'s). Flax is imported only for a Flax layer. Shape
letters: see relaymoe_jax.
"""

import dataclasses
import re
import sys

import chex
import jax
import jax.numpy as jnp

from relaymoe_jax.errors import UserError
from relaymoe_jax.moe import every_call_dispatched_by
from relaymoe_jax.testing.closeness import assert_trees_close, cotangent, named_leaves, where_they_differ


def layer_values_and_grads(layer, x, *, variables=None, dispatcher=None, float32=False, cotangent_seed=0):
  """A MoE layer's output and the gradients of Σ y·c w.r.t. x and every parameter, jitted.

  Args:
    layer: an `rm.linen.MoE` (with `variables`) or an `rm.nnx.MoE`.
    x: its input [..., D].
    dispatcher: if given, replaces the layer's (and drops its options).
    float32: run on float32 copies of x and the parameters, computing in float32.

  Returns:
    (y, {"x": dx, "params": {name: gradient}}).
  """
  c = cotangent(x.shape, cotangent_seed)
  changes = dict(dispatcher=dispatcher, dispatcher_options=None) if dispatcher is not None else {}
  if float32:
    changes["dtype"] = jnp.float32
    x = x.astype(jnp.float32)
  if _is_linen(layer):
    module, params = layer.clone(**changes), variables["params"]
    apply = module.apply

    def run(params, x):
      return apply({"params": params}, x)[0]
  else:
    from flax import nnx  # only for an NNX layer: the other checks need no Flax
    graphdef, params = nnx.split(layer, nnx.Param)
    config = dataclasses.replace(layer.config, **changes)

    def run(params, x):
      module = nnx.merge(graphdef, params)
      module.config = config
      return module(x)[0]

  if float32:
    params = jax.tree.map(lambda a: a.astype(jnp.float32), params)

  @jax.jit
  def values_and_grads(params, x):
    def loss(params, x):
      y = run(params, x)
      return jnp.sum(y.astype(jnp.float32) * c), y
    (_, y), (d_params, dx) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)
    return y, {"x": dx, "params": d_params}

  y, grads = values_and_grads(params, x)
  if not _is_linen(layer):  # plain arrays by name, as Linen's, not nnx.Param-wrapped
    grads["params"] = nnx.to_pure_dict(grads["params"])
  return y, grads


def _is_linen(layer):
  linen = sys.modules.get("flax.linen")  # a Linen module exists only where Flax was imported
  return linen is not None and isinstance(layer, linen.Module)


def _is_flax_layer(layer):
  return _is_linen(layer) or type(layer).__module__ == "relaymoe_jax.layers.nnx"


def assert_layer_matches_dense_oracle(layer, x, *, rtol, variables=None, cotangent_seed=0):
  """Asserts that a MoE layer (`rm.linen.MoE` with its `variables`, or `rm.nnx.MoE`) equals itself under the
  dense float32 oracle dispatcher, in values and in the gradients w.r.t. x and every parameter (router, experts,
  shared expert). Any other block (an Equinox module, a function) goes to `assert_block_matches_dense_oracle`.

  Returns:
    the relative error of each array ("y", "x", and "params" by name).

  Raises:
    AssertionError: naming each array over rtol, a shape (y must have x's), a dtype (y: the layer's compute
      dtype, else x's) or a non-finite value.
  """
  if not _is_flax_layer(layer):
    return assert_block_matches_dense_oracle(layer, x, rtol=rtol, cotangent_seed=cotangent_seed)
  kw = dict(variables=variables, cotangent_seed=cotangent_seed)
  y, grads = layer_values_and_grads(layer, x, **kw)
  config = layer.block_config() if _is_linen(layer) else layer.config
  chex.assert_shape(y, x.shape)
  chex.assert_type(y, config.dtype or x.dtype)
  y_ref, grads_ref = layer_values_and_grads(layer, x, dispatcher="dense", float32=True, **kw)
  actual, expected = dict(y=y, **grads), dict(y=y_ref, **grads_ref)
  try:
    return assert_trees_close(actual, expected, rtol)
  except AssertionError as e:
    where = where_they_differ(_layer_named(actual), _layer_named(expected), rtol)
    raise AssertionError(f"{e}; {where}") from None


def block_values_and_grads(block, x, *, dispatcher=None, float32=False, cotangent_seed=0):
  """A whole MoE block's output and the gradients of Σ y·c (c = `cotangent`) w.r.t. x and each of its parameters,
  jitted.

  Args:
    block: any callable x -> y or (y, aux) that calls `moe_ffn` (router and all): a function, or a pytree whose
      floating-point arrays are its parameters (an Equinox module, a `jax.tree_util.Partial` over your weights).
    x: its input [..., D].
    dispatcher: if given, every `moe_ffn` in it runs this instead of its own (options dropped).
    float32: run on float32 copies of x and the parameters.

  Returns:
    (y, {"x": dx, "params": {name: gradient}}), parameters named by their path ("moe.w_gate_EDF").

  Raises:
    UserError: the block ran no `moe_ffn` while traced (none in it, or a `jit` inside it served a trace cached
      before: then the oracle would not be the oracle; pass the block unjitted).
  """
  leaves, treedef = jax.tree_util.tree_flatten(block)
  is_param = [isinstance(a, jax.Array) and jnp.issubdtype(a.dtype, jnp.inexact) for a in leaves]
  params = [a for a, p in zip(leaves, is_param) if p]
  names = [name for (name, a), p in zip(named_leaves(block).items(), is_param) if p]
  if float32:
    params, x = [a.astype(jnp.float32) for a in params], x.astype(jnp.float32)
  c = cotangent(x.shape, cotangent_seed)

  def loss(params, x):
    given = iter(params)
    module = jax.tree_util.tree_unflatten(treedef, [next(given) if p else a for a, p in zip(leaves, is_param)])
    y = module(x)
    y = y[0] if isinstance(y, tuple) else y
    return jnp.sum(y.astype(jnp.float32) * c), y

  with every_call_dispatched_by(dispatcher) as calls:
    (_, y), (d_params, dx) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
  if not calls:
    raise UserError(f"{_short(block)} ran no moe_ffn while traced: none in it, or a jit inside it gave a trace "
                    "cached before; pass the block without its jit")
  return y, {"x": dx, "params": dict(zip(names, d_params))}


def assert_block_matches_dense_oracle(block, x, *, rtol, cotangent_seed=0):
  """Asserts that a whole MoE block of yours (any callable x -> y or (y, aux) calling `moe_ffn`, router and all:
  an Equinox module, a function, a `jax.tree_util.Partial` over your weights, a `shard_map` around it) equals
  itself with every `moe_ffn` in it run by the dense float32 oracle on float32 copies of x and its parameters, in
  values and in the gradients w.r.t. x and every parameter (`block_values_and_grads`).

  Returns:
    the relative error of each array ("y", "x", and "params" by name).

  Raises:
    AssertionError: naming each array over rtol (with the experts and token rows that differ), a shape (y must
      have x's) or a non-finite value, in one line.
  """
  y, grads = block_values_and_grads(block, x, cotangent_seed=cotangent_seed)
  assert jnp.shape(y) == jnp.shape(x), f"y {jnp.shape(y)} does not have x's shape {jnp.shape(x)}"
  y_ref, grads_ref = block_values_and_grads(block, x, dispatcher="dense", float32=True, cotangent_seed=cotangent_seed)
  actual, expected = dict(y=y, **grads), dict(y=y_ref, **grads_ref)
  try:
    return assert_trees_close(actual, expected, rtol)
  except AssertionError as e:
    raise AssertionError(f"{e}; {where_they_differ(_layer_named(actual), _layer_named(expected), rtol)}") from None


def _short(block, most=80):
  text = repr(block).replace("\n", " ")
  return text if len(text) <= most else text[:most] + "..."


def _layer_named(outputs):
  """A layer's output and gradients under `where_they_differ`'s names: token rows of y and dx, experts of the
  expert weights' gradients."""
  d = outputs["y"].shape[-1]
  experts = {f"d{name}": g for name, g in outputs["params"].items() if re.search(r"(^|\.)w_\w*_E[A-Z]*$", name)}
  return dict(y_TD=outputs["y"].reshape(-1, d), dx_TD=outputs["x"].reshape(-1, d), **experts)
