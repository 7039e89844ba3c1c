"""How close two pytrees of arrays are, and where they differ: the comparisons of `relaymoe_jax.testing`.

Closeness is the max-norm relative error max|a − b| / max|b| of each array, not an elementwise tolerance: a
gradient's small entries carry the absolute rounding of its large ones. No communication. Shape letters: see
relaymoe_jax.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np


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
