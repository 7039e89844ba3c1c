"""Checks for your own tests: random MoE inputs, and a MoE block under a dispatcher against the dense oracle.

No communication of its own: the checks call `moe_ffn` on your mesh, once with your dispatcher and once with
"dense" on float32 copies of the same inputs. Not imported by `import relaymoe_jax` (it needs chex, not pytest):

    import relaymoe_jax.testing as rmt

    inputs = rmt.random_moe_inputs(0, tokens=64, d_model=16, d_ff=24, num_experts=16, top_k=4)
    rmt.assert_matches_dense_oracle(mesh=mesh, dispatcher="ring_expert", rtol=1e-5, **inputs)

Closeness is the max-norm relative error max|a − b| / max|b| of each array, not an elementwise tolerance: a
gradient's small entries carry the absolute rounding of its large ones. Shape letters: see relaymoe_jax.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np

from relaymoe_jax.axes import EXPERT
from relaymoe_jax.moe import moe_ffn

MOE_ARGS = ("x_TD", "idx_TK", "w_TK", "w_gate_EDF", "w_up_EDF", "w_down_EFD")
DIFF_ARGS = ("x_TD", "w_TK", "w_gate_EDF", "w_up_EDF", "w_down_EFD")  # what `moe_ffn` is differentiable in


def random_moe_inputs(seed, tokens, d_model, d_ff, num_experts, top_k, *, skew=False, dtype=jnp.float32):
  """Random tokens, routing and SwiGLU experts, as the keyword arguments of `moe_ffn` (names in `MOE_ARGS`).

  Args:
    seed: NumPy seed.
    tokens, d_model, d_ff, num_experts, top_k: T, D, F, E, K.
    skew: False: each token picks top_k distinct experts at random. True: every token picks from the first top_k
      experts only (all pairs land in partition 0 whenever top_k ≤ L), the worst case for a capacity-bound
      dispatcher and for one hop of the ring.
    dtype: of every floating array; idx_TK is int32.

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
  return {name: jnp.asarray(a, None if name == "idx_TK" else dtype) for name, a in arrays.items()}


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
  chex.assert_trees_all_equal_shapes(actual, expected)
  chex.assert_tree_all_finite(actual)
  errors = relative_error(actual, expected)
  over = {jax.tree_util.keystr(path): err for path, err in jax.tree_util.tree_leaves_with_path(errors) if err > rtol}
  assert not over, "relative error over rtol={:.3g}: {}".format(
      rtol, ", ".join(f"{name} {err:.3g}" for name, err in over.items()))
  return errors


def cotangent(shape, seed=0):
  """A fixed random float32 output cotangent c: the checks differentiate Σ y·c."""
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


@functools.partial(jax.jit, static_argnames=("mesh", "dispatcher", "axes", "options"))
def _values_and_grads(inputs, c_TD, *, mesh, dispatcher, axes, options):
  expert_axis, token_axes, tensor_axis = axes

  def loss(diff, idx_TK):
    y_TD = moe_ffn(diff["x_TD"], idx_TK, diff["w_TK"], diff["w_gate_EDF"], diff["w_up_EDF"], diff["w_down_EFD"],
                   mesh=mesh, dispatcher=dispatcher, expert_axis=expert_axis, token_axes=token_axes,
                   tensor_axis=tensor_axis, **dict(options))
    return jnp.sum(y_TD.astype(jnp.float32) * c_TD), y_TD

  diff = {name: inputs[name] for name in DIFF_ARGS}
  (_, y_TD), grads = jax.value_and_grad(loss, has_aux=True)(diff, inputs["idx_TK"])
  return y_TD, grads


def values_and_grads(inputs, *, mesh, dispatcher, expert_axis=EXPERT, token_axes=None, tensor_axis=None,
                     cotangent_seed=0, **options):
  """`moe_ffn`'s output and the gradients of Σ y·c (c = `cotangent`) w.r.t. everything it is differentiable in.

  Jitted with idx_TK traced, so out-of-range ids are not rejected but take the jit behaviour (see `moe_ffn`), and
  calls with the same shapes, mesh, dispatcher and options share one compiled function.

  Args:
    inputs: `moe_ffn`'s arrays by name (`MOE_ARGS`), e.g. from `random_moe_inputs`.
    mesh, dispatcher, expert_axis, token_axes, tensor_axis, **options: as for `moe_ffn`.
    cotangent_seed: seed of c.

  Returns:
    (y_TD, dict of gradients keyed by the names in `DIFF_ARGS`).
  """
  axes = (expert_axis, tuple(token_axes) if token_axes else None, tensor_axis)
  c_TD = cotangent(inputs["x_TD"].shape, cotangent_seed)
  return _values_and_grads({name: inputs[name] for name in MOE_ARGS}, c_TD, mesh=mesh, dispatcher=dispatcher,
                           axes=axes, options=tuple(sorted(options.items())))


def dense_oracle(inputs, **kwargs):
  """`values_and_grads` of the "dense" dispatcher on float32 copies of `inputs` (bfloat16 inputs stay as rounded);
  kwargs: the same mesh and axes, no dispatcher options."""
  f32 = {k: v.astype(jnp.float32) if jnp.issubdtype(v.dtype, jnp.floating) else v for k, v in inputs.items()}
  return values_and_grads(f32, dispatcher="dense", **kwargs)


def assert_matches_dense_oracle(*, mesh, dispatcher, rtol, x_TD, idx_TK, w_TK, w_gate_EDF, w_up_EDF, w_down_EFD,
                                expert_axis=EXPERT, token_axes=None, tensor_axis=None, cotangent_seed=0, **options):
  """Asserts that `moe_ffn` under `dispatcher` equals the dense float32 oracle, in values and in the gradients
  w.r.t. x_TD, w_TK and the three expert weights.

  Also asserts that y_TD and every gradient have their input's shape and dtype and are finite.

  Args:
    mesh, dispatcher, expert_axis, token_axes, tensor_axis, **options: as for `moe_ffn`.
    rtol: the largest max-norm relative error allowed per array (float32: ~1e-5; bfloat16: ~3e-2).
    x_TD, idx_TK, w_TK, w_gate_EDF, w_up_EDF, w_down_EFD: `moe_ffn`'s inputs.
    cotangent_seed: seed of the output cotangent the gradients are taken against.

  Returns:
    the relative error of each array, keyed "y_TD" and "d" + input name ("dx_TD", "dw_gate_EDF", ...).

  Raises:
    AssertionError: naming each array that differs by more than rtol, or a shape, dtype or non-finite value.
  """
  inputs = dict(x_TD=x_TD, idx_TK=idx_TK, w_TK=w_TK, w_gate_EDF=w_gate_EDF, w_up_EDF=w_up_EDF,
                w_down_EFD=w_down_EFD)
  axes = dict(mesh=mesh, expert_axis=expert_axis, token_axes=token_axes, tensor_axis=tensor_axis,
              cotangent_seed=cotangent_seed)
  y_TD, grads = values_and_grads(inputs, dispatcher=dispatcher, **axes, **options)
  chex.assert_trees_all_equal_shapes_and_dtypes((y_TD, grads), (x_TD, {k: inputs[k] for k in DIFF_ARGS}))
  y_ref, grads_ref = dense_oracle(inputs, **axes)
  return assert_trees_close(_named(y_TD, grads), _named(y_ref, grads_ref), rtol)


def _named(y_TD, grads):
  return dict(y_TD=y_TD, **{f"d{name}": g for name, g in grads.items()})
