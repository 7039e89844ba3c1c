"""`relaymoe_jax.testing`, the oracle check offered to users: it passes a correct block and fails, naming the array,
a block wrong in its values, in one gradient, or in its output dtype."""

import dataclasses
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import relaymoe_jax as rm
import relaymoe_jax.testing as rmt
from conftest import mesh_of


def _inputs(dtype=jnp.float32):
  return rmt.random_moe_inputs(1, tokens=32, d_model=8, d_ff=12, num_experts=8, top_k=2, dtype=dtype)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Scaled:
  """The dense dispatcher with its output scaled: wrong values (and so wrong gradients)."""

  factor: float

  def __call__(self, *args, layout):
    return rm.Dense()(*args, layout=layout) * self.factor


@dataclasses.dataclass(frozen=True, kw_only=True)
class _FrozenDown:
  """Right values, but no gradient reaches w_down."""

  def __call__(self, *args, layout):
    return rm.Dense()(*args[:-1], jax.lax.stop_gradient(args[-1]), layout=layout)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Float32Out:
  """Right values, returned in float32 whatever the inputs' dtype."""

  def __call__(self, *args, layout):
    f32 = [a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a for a in args]
    return rm.Dense()(*f32, layout=layout)


def test_a_correct_block_passes_and_every_array_is_reported():
  errors = rmt.assert_matches_dense_oracle(mesh=mesh_of((4,), (rm.EXPERT,)), dispatcher="ring_expert", rtol=1e-5,
                                           **_inputs())
  assert set(errors) == {"y_TD", "dx_TD", "dw_TK", "dw_gate_EDF", "dw_up_EDF", "dw_down_EFD"}
  assert all(0 <= err <= 1e-5 for err in errors.values())


@pytest.mark.parametrize("dispatcher, message", [
    (_Scaled(factor=1.001), r"dx_TD 0.001, y_TD 0.001; "),
    (_FrozenDown(), r"relative error over rtol=1e-05: dw_down_EFD 1; experts that differ: \[0, 1, 2, 3, 4, 5, "
                    r"6, 7\]; token rows that differ: none$"),
], ids=["values", "one gradient"])
def test_a_wrong_block_fails_naming_the_array(dispatcher, message):
  with pytest.raises(AssertionError, match=message):
    rmt.assert_matches_dense_oracle(mesh=mesh_of((4,), (rm.EXPERT,)), dispatcher=dispatcher, rtol=1e-5, **_inputs())


def _permuted_experts(x_TD, idx_TK, w_TK, w_gate_EDF, w_up_EDF, w_down_EFD):
  """A user's wrapper with a bug: experts 2 and 5 swapped in the weights it passes on."""
  perm = jnp.array([0, 1, 5, 3, 4, 2, 6, 7])
  return rm.moe_ffn(x_TD, idx_TK, w_TK, w_gate_EDF[perm], w_up_EDF[perm], w_down_EFD[perm],
                    mesh=mesh_of((4,), (rm.EXPERT,)), dispatcher="ring_expert")


def _correct_wrapper(x_TD, idx_TK, w_TK, w_gate_EDF, w_up_EDF, w_down_EFD):
  return rm.moe_ffn(x_TD, idx_TK, w_TK, w_gate_EDF, w_up_EDF, w_down_EFD, mesh=mesh_of((4,), (rm.EXPERT,)),
                    dispatcher="all_to_all")


def test_a_users_block_is_checked_and_a_permuted_expert_wrapper_is_caught_by_expert():
  mesh = mesh_of((4,), (rm.EXPERT,))
  errors = rmt.assert_matches_dense_oracle(_correct_wrapper, mesh=mesh, rtol=1e-5, **_inputs())
  assert max(errors.values()) <= 1e-5
  with pytest.raises(AssertionError, match=r"experts that differ: \[2, 5\]; token rows that differ: \[\d"):
    rmt.assert_matches_dense_oracle(_permuted_experts, mesh=mesh, rtol=1e-5, **_inputs())


@dataclasses.dataclass(frozen=True, kw_only=True)
class _SwappedExperts:
  """A dispatcher with a bug: experts 2 and 5 swapped in the weights it computes with."""

  def __call__(self, x_TD, idx_TK, w_TK, *weights, layout):
    perm = jnp.array([0, 1, 5, 3, 4, 2, 6, 7])
    return rm.Dense()(x_TD, idx_TK, w_TK, *(w[perm] for w in weights), layout=layout)


def test_the_layer_check_names_experts_and_rows_and_returns_floats():
  """The layer form names what the function form names; the NNX form's errors are floats by parameter name."""
  mesh = mesh_of((4,), (rm.EXPERT,))
  x = jnp.asarray(np.random.default_rng(2).normal(size=(4, 8, 8)), jnp.float32)
  layer = rm.nnx.MoE(8, num_experts=8, top_k=2, d_ff=12, mesh=mesh, dispatcher="dense", rngs=nnx.Rngs(0))
  errors = rmt.assert_layer_matches_dense_oracle(layer, x, rtol=1e-5)
  assert type(errors["y"]) is float and set(errors["params"]) == set(layer.names)
  assert all(type(e) is float for e in errors["params"].values())  # not nnx.Param-wrapped
  layer.config = dataclasses.replace(layer.config, dispatcher=_SwappedExperts())
  with pytest.raises(AssertionError, match=r"experts that differ: \[2, 5\]; token rows that differ: \[\d"):
    rmt.assert_layer_matches_dense_oracle(layer, x, rtol=1e-5)


def test_where_they_differ_names_experts_and_rows():
  expected = dict(y_TD=jnp.ones((6, 2)), dw_gate_EDF=jnp.ones((4, 2, 3)))
  actual = dict(y_TD=expected["y_TD"].at[3, 1].set(2.0), dw_gate_EDF=expected["dw_gate_EDF"].at[1].set(0.0))
  assert rmt.where_they_differ(actual, expected, 1e-3) == "experts that differ: [1]; token rows that differ: [3]"


def test_block_and_dispatcher_are_one_or_the_other():
  with pytest.raises(ValueError, match="give one of block="):
    rmt.assert_matches_dense_oracle(_correct_wrapper, mesh=mesh_of((4,), (rm.EXPERT,)), dispatcher="dense",
                                    rtol=1e-5, **_inputs())


def test_a_block_returning_another_dtype_fails():
  with pytest.raises(AssertionError, match="dtype"):
    rmt.assert_matches_dense_oracle(mesh=mesh_of((4,), (rm.EXPERT,)), dispatcher=_Float32Out(), rtol=3e-2,
                                    **_inputs(jnp.bfloat16))


def test_relative_error_is_max_norm_per_leaf():
  actual = {"a": jnp.array([1.0, 2.0]), "b": [jnp.array([[0.0, -3.0]]), jnp.zeros((0, 2))]}
  expected = {"a": jnp.array([1.0, 4.0]), "b": [jnp.array([[1.0, -2.0]]), jnp.zeros((0, 2))]}
  assert rmt.relative_error(actual, expected) == {"a": 0.5, "b": [0.5, 0.0]}


def test_assert_trees_close_rejects_non_finite_and_mismatched_shapes():
  with pytest.raises(AssertionError):
    rmt.assert_trees_close({"a": jnp.array([jnp.nan, 1.0])}, {"a": jnp.array([1.0, 1.0])}, rtol=10.0)
  with pytest.raises(AssertionError):
    rmt.assert_trees_close({"a": jnp.ones((2, 3))}, {"a": jnp.ones((3, 2))}, rtol=10.0)
  with pytest.raises(AssertionError, match=r"over rtol=0.1: b 0.5$"):
    rmt.assert_trees_close({"a": jnp.ones(2), "b": jnp.ones(2)}, {"a": jnp.ones(2), "b": jnp.full(2, 2.0)}, 0.1)


@pytest.mark.parametrize("skew", [False, True])
def test_random_moe_inputs(skew):
  inputs = rmt.random_moe_inputs(3, 40, 8, 12, 16, 4, skew=skew, dtype=jnp.bfloat16)
  shapes = dict(x_TD=(40, 8), idx_TK=(40, 4), w_TK=(40, 4), w_gate_EDF=(16, 8, 12), w_up_EDF=(16, 8, 12),
                w_down_EFD=(16, 12, 8))
  assert {k: v.shape for k, v in inputs.items()} == shapes and tuple(inputs) == rmt.MOE_ARGS
  assert inputs["idx_TK"].dtype == jnp.int32 and inputs["x_TD"].dtype == jnp.bfloat16
  idx = np.asarray(inputs["idx_TK"])
  assert all(len(set(row)) == 4 for row in idx), "a token's experts are distinct"
  assert idx.min() >= 0 and idx.max() < (4 if skew else 16)
  assert (idx.max() >= 4) == (not skew)
  np.testing.assert_allclose(np.asarray(inputs["w_TK"], np.float32).sum(-1), 1.0, rtol=1e-2)
  again = rmt.random_moe_inputs(3, 40, 8, 12, 16, 4, skew=skew, dtype=jnp.bfloat16)
  assert all(np.array_equal(np.asarray(inputs[k]), np.asarray(again[k])) for k in inputs)
  assert rmt.random_moe_inputs(3, 0, 8, 12, 16, 4)["idx_TK"].shape == (0, 4)


def test_package_import_leaves_testing_and_pytest_out():
  """`import relaymoe_jax` does not load the testing module; the testing module does not need pytest."""
  repo = pathlib.Path(__file__).resolve().parents[1]
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")])))
  script = ("import sys, relaymoe_jax; assert 'relaymoe_jax.testing' not in sys.modules; "
            "import relaymoe_jax.testing; assert 'pytest' not in sys.modules, 'pytest imported'")
  subprocess.run([sys.executable, "-c", script], check=True, env=env, cwd=repo)
