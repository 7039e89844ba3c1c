"""Checks for your own tests: random MoE inputs, and a MoE block under a dispatcher against the dense oracle.

No communication of its own: the checks call `moe_ffn` on your mesh, once with your dispatcher and once with
"dense" on float32 copies of the same inputs. Not imported by `import relaymoe_jax` (it needs chex, not pytest):

    import relaymoe_jax.testing as rmt

    inputs = rmt.random_moe_inputs(0, tokens=64, d_model=16, d_ff=24, num_experts=16, top_k=4)
    rmt.assert_matches_dense_oracle(mesh=mesh, dispatcher="ring_expert", rtol=1e-5, **inputs)
    rmt.assert_block_matches_dense_oracle(my_block, x_BSD, rtol=1e-5)   # a whole block: router and all

Closeness is the max-norm relative error max|a − b| / max|b| of each array, not an elementwise tolerance: a
gradient's small entries carry the absolute rounding of its large ones. Shape letters: see relaymoe_jax.
"""

import dataclasses
import functools
import re
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np

from relaymoe_jax import activations
from relaymoe_jax.axes import EXPERT
from relaymoe_jax.errors import UserError
from relaymoe_jax.moe import every_call_dispatched_by, moe_ffn

MOE_ARGS = ("x_TD", "idx_TK", "w_TK", "w_gate_EDF", "w_up_EDF", "w_down_EFD")
DIFF_ARGS = ("x_TD", "w_TK", "w_gate_EDF", "w_up_EDF", "w_down_EFD")  # what `moe_ffn` is differentiable in


def random_moe_inputs(seed, tokens, d_model, d_ff, num_experts, top_k, *, skew=False, dtype=jnp.float32,
                      activation="swiglu"):
  """Random tokens, routing and experts, as the keyword arguments of `moe_ffn` (names in `MOE_ARGS`).

  Args:
    seed: NumPy seed.
    tokens, d_model, d_ff, num_experts, top_k: T, D, F, E, K.
    skew: False: each token picks top_k distinct experts at random. True: every token picks from the first top_k
      experts only (all pairs land in partition 0 whenever top_k ≤ L), the worst case for a capacity-bound
      dispatcher and for one hop of the ring.
    dtype: of every floating array; idx_TK is int32.
    activation: the experts' (`moe_ffn`'s `activation=`): a plain two-matrix one gets w_up_EDF None (the other
      arrays are the same as for a gated one).

  Returns:
    dict of x_TD [T, D], idx_TK [T, K], w_TK [T, K] (softmax rows), w_gate_EDF, w_up_EDF [E, D, F], w_down_EFD
    [E, F, D] (scaled by 1/sqrt of their input width).
  """
  rng = np.random.default_rng(seed)
  choices = np.arange(top_k) if skew else np.arange(num_experts)
  idx = np.array([rng.permutation(choices)[:top_k] for _ in range(tokens)], np.int32).reshape(tokens, top_k)
  logits = rng.normal(size=(tokens, top_k))
  w = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
  x = rng.normal(size=(tokens, d_model))
  w_gate = rng.normal(size=(num_experts, d_model, d_ff)) / np.sqrt(d_model)
  w_up = rng.normal(size=(num_experts, d_model, d_ff)) / np.sqrt(d_model)
  w_down = rng.normal(size=(num_experts, d_ff, d_model)) / np.sqrt(d_ff)
  arrays = dict(x_TD=x, idx_TK=idx, w_TK=w, w_gate_EDF=w_gate, w_up_EDF=w_up, w_down_EFD=w_down)
  if not activations.is_gated(activation):
    arrays["w_up_EDF"] = None
  return {name: None if a is None else jnp.asarray(a, None if name == "idx_TK" else dtype)
          for name, a in arrays.items()}


def relative_error(actual, expected):
  """max |a − b| / max |b| of each leaf pair, in float32 (the denominator floored at 1e-30).

  Returns:
    a pytree shaped like `expected` whose leaves are Python floats.
  """

  def one(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    if not b.size:
      return 0.0
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))

  return jax.tree.map(one, actual, expected)


def assert_trees_close(actual, expected, rtol):
  """Same structure and shapes, `actual` finite, and each leaf's `relative_error` at most rtol.

  Raises:
    AssertionError: naming every leaf over rtol and its error.
  """
  actual_named, expected_named = named_leaves(actual), named_leaves(expected)
  assert list(actual_named) == list(expected_named), (
      f"different arrays: {_listed(actual_named)} against {_listed(expected_named)}")
  shapes = {n: (jnp.shape(a), jnp.shape(expected_named[n])) for n, a in actual_named.items()}
  wrong = {n: f"{a} against {b}" for n, (a, b) in shapes.items() if a != b}
  assert not wrong, f"shapes differ: {wrong}"
  non_finite = [n for n, a in actual_named.items() if not np.all(np.isfinite(np.asarray(a, np.float32)))]
  assert not non_finite, f"not finite: {non_finite}"
  errors = relative_error(actual, expected)
  over = {n: err for n, err in named_leaves(errors).items() if err > rtol}
  assert not over, "relative error over rtol={:.3g}: {}".format(
      rtol, ", ".join(f"{name} {err:.3g}" for name, err in over.items()))
  return errors


def named_leaves(tree):
  """{readable name: leaf}: a leaf's path joined by dots ("params.w_gate_EDF", "layers.0.moe.router_DE"), without
  the positions that lead to the first name (a `jax.tree_util.Partial`'s "0.0." before its weights' names)."""
  return {_readable(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def _readable(path):
  keys = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
  named = [i for i, k in enumerate(keys) if not k.isdigit()]
  return ".".join(keys[named[0] if named else 0:])


def cotangent(shape, seed=0):
  """A fixed random float32 output cotangent c: the checks differentiate Σ y·c."""
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


@functools.partial(jax.jit, static_argnames=("block", "mesh", "dispatcher", "axes", "activation", "options"))
def _values_and_grads(inputs, c_TD, *, block, mesh, dispatcher, axes, activation, options):
  expert_axis, token_axes, tensor_axis = axes
  if block is None:
    block = functools.partial(moe_ffn, mesh=mesh, dispatcher=dispatcher, expert_axis=expert_axis,
                              token_axes=token_axes, tensor_axis=tensor_axis, activation=activation,
                              **dict(options))

  def loss(diff, idx_TK):
    y_TD = block(diff["x_TD"], idx_TK, diff["w_TK"], diff["w_gate_EDF"], diff["w_up_EDF"], diff["w_down_EFD"])
    return jnp.sum(y_TD.astype(jnp.float32) * c_TD), y_TD

  diff = {name: inputs[name] for name in DIFF_ARGS}
  (_, y_TD), grads = jax.value_and_grad(loss, has_aux=True)(diff, inputs["idx_TK"])
  return y_TD, grads


def values_and_grads(inputs, *, mesh=None, dispatcher=None, block=None, expert_axis=EXPERT, token_axes=None,
                     tensor_axis=None, activation="swiglu", cotangent_seed=0, **options):
  """`moe_ffn`'s (or `block`'s) output and the gradients of Σ y·c (c = `cotangent`) w.r.t. everything it is
  differentiable in.

  Jitted with idx_TK traced, so out-of-range ids are not rejected but take the jit behaviour (see `moe_ffn`), and
  calls with the same shapes, mesh, dispatcher and options share one compiled function.

  Args:
    inputs: `moe_ffn`'s arrays by name (`MOE_ARGS`), e.g. from `random_moe_inputs`.
    mesh, dispatcher, expert_axis, token_axes, tensor_axis, activation, **options: as for `moe_ffn`.
    block: instead of `moe_ffn` and those, a callable with `moe_ffn`'s positional signature (x_TD, idx_TK, w_TK,
      w_gate_EDF, w_up_EDF, w_down_EFD) returning y_TD; hashable (a function, not a fresh lambda per call, shares
      the compiled function).
    cotangent_seed: seed of c.

  Returns:
    (y_TD, dict of gradients keyed by the names in `DIFF_ARGS`; None for a plain expert's absent w_up_EDF).
  """
  axes = (expert_axis, tuple(token_axes) if token_axes else None, tensor_axis)
  c_TD = cotangent(inputs["x_TD"].shape, cotangent_seed)
  if block is not None and not _hashable(block):
    block = _ByIdentity(block)
  return _values_and_grads({name: inputs[name] for name in MOE_ARGS}, c_TD, block=block, mesh=mesh,
                           dispatcher=dispatcher, axes=axes, activation=activation,
                           options=tuple(sorted(options.items())))


def _hashable(block):
  try:
    hash(block)
  except TypeError:
    return False
  return True


class _ByIdentity:
  """An unhashable block (an Equinox bound method holds arrays) as a static argument of the jitted check: hashed
  by identity, so it is compiled once per object."""

  def __init__(self, block):
    self.block = block

  def __call__(self, *args):
    return self.block(*args)


def dense_oracle(inputs, **kwargs):
  """`values_and_grads` of `moe_ffn`'s "dense" dispatcher on float32 copies of `inputs` (bfloat16 inputs stay as
  rounded); kwargs: the same mesh, axes and activation, no dispatcher options."""
  f32 = {k: v.astype(jnp.float32) if v is not None and jnp.issubdtype(v.dtype, jnp.floating) else v
         for k, v in inputs.items()}
  return values_and_grads(f32, dispatcher="dense", **kwargs)


def assert_matches_dense_oracle(block=None, *, mesh=None, dispatcher=None, rtol, x_TD, idx_TK, w_TK, w_gate_EDF,
                                w_up_EDF, w_down_EFD, expert_axis=EXPERT, token_axes=None, tensor_axis=None,
                                activation="swiglu", cotangent_seed=0, **options):
  """Asserts that your MoE block (`block`, or `moe_ffn` under `dispatcher`) equals the dense float32 oracle, in
  values and in the gradients w.r.t. x_TD, w_TK and the expert weights.

  Also asserts that y_TD and every gradient have their input's shape and dtype and are finite. A failure names each
  array over rtol, the experts whose weight gradients differ and the token rows whose output or dx differ, so a
  wrapper that permutes experts or mixes up rows shows where.

  Args:
    block: a callable with `moe_ffn`'s positional signature (x_TD, idx_TK, w_TK, w_gate_EDF, w_up_EDF,
      w_down_EFD) returning y_TD: your wrapper around it. None: `moe_ffn` with `dispatcher` and the arguments
      below. (For a Flax layer, see `assert_layer_matches_dense_oracle`.)
    mesh, dispatcher, expert_axis, token_axes, tensor_axis, **options: as for `moe_ffn`; the oracle runs on
      `mesh` (None: the `jax.set_mesh` context's) with these axes.
    activation: the experts' (`moe_ffn`'s; w_up_EDF None for a plain one): the oracle's, and `moe_ffn`'s under
      `dispatcher`.
    rtol: the largest max-norm relative error allowed per array (float32: ~1e-5; bfloat16: ~3e-2).
    x_TD, idx_TK, w_TK, w_gate_EDF, w_up_EDF, w_down_EFD: the block's inputs.
    cotangent_seed: seed of the output cotangent the gradients are taken against.

  Returns:
    the relative error of each array, keyed "y_TD" and "d" + input name ("dx_TD", "dw_gate_EDF", ...).

  Raises:
    AssertionError: naming each array that differs by more than rtol (with its experts or rows), or a shape,
      dtype or non-finite value.
  """
  if (block is None) == (dispatcher is None):
    raise UserError("give one of block= (your callable) and dispatcher= (moe_ffn's)")
  inputs = dict(x_TD=x_TD, idx_TK=idx_TK, w_TK=w_TK, w_gate_EDF=w_gate_EDF, w_up_EDF=w_up_EDF,
                w_down_EFD=w_down_EFD)
  axes = dict(mesh=mesh, expert_axis=expert_axis, token_axes=token_axes, tensor_axis=tensor_axis,
              activation=activation, cotangent_seed=cotangent_seed)
  y_TD, grads = values_and_grads(inputs, block=block, dispatcher=dispatcher, **axes, **options)
  chex.assert_trees_all_equal_shapes_and_dtypes((y_TD, grads), (x_TD, {k: inputs[k] for k in DIFF_ARGS}))
  y_ref, grads_ref = dense_oracle(inputs, **axes)
  actual, expected = _named(y_TD, grads), _named(y_ref, grads_ref)
  try:
    return assert_trees_close(actual, expected, rtol)
  except AssertionError as e:
    raise AssertionError(f"{e}; {where_they_differ(actual, expected, rtol)}") from None


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


def where_they_differ(actual, expected, rtol):
  """Which experts (dim 0 of the "dw_*_E.." arrays) and which token rows (dim 0 of "y_TD", "dx_TD", "dw_TK")
  differ, each slice judged against its whole array's max |b|: a sentence for an assertion message."""
  experts, rows = set(), set()
  for name, a in actual.items():
    a, b = np.asarray(a, np.float32), np.asarray(expected[name], np.float32)
    if not b.size:
      continue
    bad = np.max(np.abs(a - b).reshape(a.shape[0], -1), axis=1) > rtol * max(float(np.max(np.abs(b))), 1e-30)
    (experts if _EXPERTS_FIRST.search(name) else rows).update(np.flatnonzero(bad).tolist())
  return "experts that differ: {}; token rows that differ: {}".format(_listed(experts), _listed(rows))


_EXPERTS_FIRST = re.compile(r"(^d|\.)w_\w*_E[A-Z]*$")  # "dw_gate_EDF", "dlayers.0.w_down_EFD": experts in dim 0


def _listed(ids, most=16):
  ids = sorted(ids)
  more = f" (and {len(ids) - most} more)" if len(ids) > most else ""
  return (str(ids[:most]) + more) if ids else "none"


def _named(y_TD, grads):
  return dict(y_TD=y_TD, **{f"d{name}": g for name, g in grads.items() if g is not None})
