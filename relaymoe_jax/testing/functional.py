"""The function form of the oracle check: random inputs, and `moe_ffn` (or a wrapper with its signature) against
the dense float32 oracle on the same inputs. No communication of its own (`moe_ffn`'s). Shape letters: see
relaymoe_jax.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np

from relaymoe_jax import activations
from relaymoe_jax.axes import EXPERT
from relaymoe_jax.errors import UserError
from relaymoe_jax.moe import moe_ffn
from relaymoe_jax.testing.closeness import assert_trees_close, cotangent, where_they_differ


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


def _named(y_TD, grads):
  return dict(y_TD=y_TD, **{f"d{name}": g for name, g in grads.items() if g is not None})
