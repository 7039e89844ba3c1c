"""The experts' activations (`moe_ffn(..., activation=)`, the layers' `activation=`): geglu and the plain
two-matrix gelu and relu (w_up_EDF None) against the dense float32 oracle, outputs and the gradients of x, the
router weights and every expert weight, through every dispatcher; the oracle itself against the formulas written
out; the rings' hand-written backward against autodiff; the SwiGLU kernel epilogue's fallback; the layers with
`activation=` and `kernel_init=`. SwiGLU is the default and every other test's (test_equivalence).

Tolerances (max |a − b| / max |b|): float32 ≤ 1e-5 (test_equivalence's); the backward against autodiff of the
same grouped matmuls ≤ 1e-6; the oracle against NumPy float64 ≤ 1e-5.
"""

import logging

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import relaymoe_jax as rm
import relaymoe_jax.testing as rmt
from conftest import assert_close, mesh_of
from relaymoe_jax import activations
from relaymoe_jax.kernels import interface as grouped_kernels, grouped_matmul as gm
from relaymoe_jax.ring.auto import plan_for
from test_equivalence import BF16_RTOL, DATA_EXPERT, E_ONLY, ETP_NAMES, F32_RTOL

TOKENS, D_MODEL, D_FF, EXPERTS, TOP_K = 32, 8, 12, 8, 2
OTHERS = ("geglu", "gelu", "relu")  # swiglu: test_equivalence


def _inputs(activation, seed=0, **kw):
  return rmt.random_moe_inputs(seed, TOKENS, D_MODEL, D_FF, EXPERTS, TOP_K, activation=activation, **kw)


def _gelu_tanh(h):
  return 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h ** 3)))


FORMULAS = {"swiglu": lambda h: h / (1 + np.exp(-h)), "geglu": _gelu_tanh, "gelu": _gelu_tanh,
            "relu": lambda h: np.maximum(h, 0)}


@pytest.mark.parametrize("activation", activations.ACTIVATIONS)
def test_dense_oracle_is_the_formula_of_each_activation(activation):
  """The oracle every dispatcher is checked against, against a per-pair NumPy float64 loop."""
  a = {k: None if v is None else np.asarray(v, np.float64) for k, v in _inputs(activation, seed=1).items()}
  expected = np.zeros_like(a["x_TD"])
  for t in range(TOKENS):
    for k in range(TOP_K):
      e = int(a["idx_TK"][t, k])
      h = FORMULAS[activation](a["x_TD"][t] @ a["w_gate_EDF"][e])
      if activation in activations.GATED:
        h = h * (a["x_TD"][t] @ a["w_up_EDF"][e])
      expected[t] += a["w_TK"][t, k] * (h @ a["w_down_EFD"][e])
  inputs = _inputs(activation, seed=1)
  actual = rm.dense_moe(*(inputs[name] for name in rmt.MOE_ARGS), activation=activation)
  assert_close(actual, expected, F32_RTOL, activation)


# Each activation and each dispatcher, gated and plain experts through each ring: `auto` runs the token ring at
# these shapes. Every pair of them, and more meshes: the slow grid below.
DEFAULT_CASES = [("geglu", "ring_expert"), ("geglu", "ring_token"), ("geglu", "all_to_all"), ("gelu", "ring_expert"),
                 ("gelu", "auto"), ("relu", "all_to_all")]


@pytest.mark.parametrize("activation, dispatcher", DEFAULT_CASES)
def test_activation_matches_oracle(activation, dispatcher):
  """On 2 data × 4 expert, float32, uniform routing."""
  if dispatcher == "auto":
    layout = rm.ExpertLayout(mesh_of((2, 4), DATA_EXPERT))
    inputs = _inputs(activation)
    assert plan_for(layout, inputs["x_TD"], inputs["idx_TK"], inputs["w_gate_EDF"], gated=False).mode == "ring_token"
  rmt.assert_matches_dense_oracle(mesh=mesh_of((2, 4), DATA_EXPERT), dispatcher=dispatcher, rtol=F32_RTOL,
                                  activation=activation, **_inputs(activation))


GRID = [((8,), E_ONLY, 16, 8, True, {}), ((4, 2), DATA_EXPERT, 16, 4, True, {"chunk_rows": (16, 4)}),
        ((2, 2, 2), ETP_NAMES, 8, 2, False, {"tensor_axis": rm.TENSOR})]


GRID_IDS = ["8-skew", "4x2-dp-ladder", "2x2x2-etp"]
GRID_DISPATCHERS = [("ring_expert", {}), ("ring_expert", {"keep_gate_up": True}),
                    ("ring_expert", {"reverse_backward": True}), ("ring_token", {}), ("auto", {}), ("all_to_all", {})]


def _grid_params():
  """CI's slow step: each dispatcher once, the activations and grid cases in turn (6 of 72); the rest is
  `pytest -m full_grid`."""
  params = []
  for i, (dispatcher, options) in enumerate(GRID_DISPATCHERS):
    for a, activation in enumerate(activations.ACTIVATIONS):
      for case in range(len(GRID)):
        representative = a == i % len(activations.ACTIVATIONS) and case == i % len(GRID)
        name = "-".join([activation, dispatcher, *options, GRID_IDS[case]])
        params.append(pytest.param(activation, dispatcher, options, case, id=name,
                                   marks=pytest.mark.slow if representative else pytest.mark.full_grid))
  return params


@pytest.mark.parametrize("activation, dispatcher, options, case", _grid_params())
def test_activation_grid_matches_oracle(activation, dispatcher, options, case):
  shape, names, e, k, skew, more = GRID[case]
  if "chunk_rows" in more and dispatcher == "all_to_all":
    more = {}
  inputs = rmt.random_moe_inputs(case, 48, D_MODEL, D_FF, e, k, skew=skew, activation=activation)
  rmt.assert_matches_dense_oracle(mesh=mesh_of(shape, names), dispatcher=dispatcher, rtol=F32_RTOL,
                                  activation=activation, **inputs, **options, **more)


@pytest.mark.parametrize("activation, dispatcher", [  # CI's slow step: each activation once; `-m full_grid`: all
    pytest.param(a, d, marks=pytest.mark.slow if i == j else pytest.mark.full_grid, id=f"{a}-{d}")
    for i, a in enumerate(OTHERS) for j, d in enumerate(["ring_expert", "ring_token", "all_to_all"])])
def test_bfloat16_activation_matches_oracle(activation, dispatcher):
  rmt.assert_matches_dense_oracle(mesh=mesh_of((2, 4), DATA_EXPERT), dispatcher=dispatcher, rtol=BF16_RTOL,
                                  activation=activation, **_inputs(activation, dtype=jnp.bfloat16))


def _chunk(activation, rows=40, groups=(10, 0, 25)):
  """One chunk's operands: rows past sum(groups) in none, as a hop's last chunk has them."""
  rng = np.random.default_rng(5)
  u = (2 if activation in activations.GATED else 1) * D_FF
  f32 = lambda *shape: jnp.asarray(rng.normal(size=shape) / np.sqrt(shape[-2] if len(shape) > 2 else 1), jnp.float32)
  return dict(x_RD=f32(rows, D_MODEL), w_in_LDU=f32(len(groups), D_MODEL, u),
              w_down_LFD=f32(len(groups), D_FF, D_MODEL), sizes_L=jnp.asarray(groups, jnp.int32),
              dy_RD=f32(rows, D_MODEL), w_R=f32(rows))


@pytest.mark.parametrize("keep", [False, True], ids=["recomputed", "kept"])
@pytest.mark.parametrize("activation", activations.ACTIVATIONS)
def test_hand_written_backward_matches_autodiff(activation, keep):
  """`expert_mlp_backward` (the rings' backward per chunk; the input projection recomputed or kept) against
  `jax.vjp` of Σ w · expert_mlp(x) · dy."""
  c = _chunk(activation)
  sizes, dy = c["sizes_L"], c["dy_RD"]

  def weighted(x, w, w_in, w_down):
    y, _ = gm.expert_mlp(x, w_in, w_down, sizes, activation=activation)
    return jnp.sum(y * w[:, None] * dy)

  expected = jax.grad(weighted, argnums=(0, 1, 2, 3))(c["x_RD"], c["w_R"], c["w_in_LDU"], c["w_down_LFD"])
  kept = gm.expert_mlp(c["x_RD"], c["w_in_LDU"], c["w_down_LFD"], sizes, activation=activation,
                       keep_gate_up=True)[1] if keep else None
  dx, dw, dw_in, dw_down = gm.expert_mlp_backward(c["x_RD"], c["w_in_LDU"], c["w_down_LFD"], sizes, dy, c["w_R"],
                                                  activation=activation, gate_up_RU=kept)
  for name, a, b in zip(("dx", "dw", "dw_in", "dw_down"), (dx, dw, dw_in, dw_down), expected):
    assert_close(a, b, 1e-6, f"{activation} {name}")


@pytest.mark.parametrize("activation", OTHERS)
def test_other_activations_fall_back_from_the_swiglu_kernel_with_a_logged_reason(activation, caplog):
  """The reference kernels' SwiGLU epilogue takes this shape for swiglu; other activations run the plain kernels
  and then the activation, saying why, and compute what `xla` computes."""
  c = _chunk(activation)
  args = (c["x_RD"], c["w_in_LDU"], c["w_down_LFD"], c["sizes_L"])
  grouped_kernels._log_swiglu_fallback.cache_clear()  # logged once per reason: an earlier test may have logged it
  with caplog.at_level(logging.WARNING):
    assert gm.SWIGLU_BACKENDS["kernel_reference"](*args[:2], c["sizes_L"], False, activation) is None
    y, _ = gm.expert_mlp(*args, activation=activation, backend="kernel_reference")
  assert (f"kernel_reference's fused gate/up kernel does not apply (the activation is {activation}, the "
          "epilogue's is swiglu)") in caplog.text
  rows = int(jnp.sum(c["sizes_L"]))
  assert_close(y[:rows], gm.expert_mlp(*args, activation=activation)[0][:rows], 1e-6, activation)
  assert gm.SWIGLU_BACKENDS["kernel_reference"](*args[:2], c["sizes_L"], False, "swiglu") is not None


@pytest.mark.parametrize("activation, dispatcher, options", [
    ("gelu", "ring_expert", {"keep_gate_up": True}), pytest.param("geglu", "all_to_all", {}, marks=pytest.mark.slow)])
def test_activation_on_the_kernel_reference_path_matches_the_oracle(activation, dispatcher, options):
  """The plain reference kernels (NaN past the groups, outputs typed invariant, as Mosaic's) with the activation
  between them: the ring's recomputing backward, and the all-to-all's autodiff through the kernels' custom_vjp."""
  inputs = rmt.random_moe_inputs(24, 32, 16, 128, 8, 2, activation=activation)
  rmt.assert_matches_dense_oracle(mesh=mesh_of((2, 4), DATA_EXPERT), dispatcher=dispatcher, rtol=F32_RTOL,
                                  activation=activation, backend="kernel_reference", **inputs, **options)


def test_bad_activations_and_up_matrices_are_refused_by_name():
  mesh = mesh_of((2, 4), DATA_EXPERT)
  gated, plain = _inputs("swiglu"), _inputs("gelu")
  with pytest.raises(ValueError, match=r"unknown activation 'tanh'; known: \['swiglu', 'geglu', 'gelu', 'relu'\]"):
    rm.moe_ffn(**gated, mesh=mesh, activation="tanh")
  with pytest.raises(ValueError, match="activation 'geglu' is gated: it needs w_up_EDF"):
    rm.moe_ffn(**plain, mesh=mesh, activation="geglu")
  with pytest.raises(ValueError, match=r"activation 'relu' is a plain two-matrix expert.*pass w_up_EDF=None, not "
                                       r"an array of shape \(8, 8, 12\)"):
    rm.moe_ffn(**gated, mesh=mesh, activation="relu")
  with pytest.raises(ValueError, match="unknown activation 'silu'"):
    rm.nnx.MoE(D_MODEL, num_experts=EXPERTS, top_k=TOP_K, d_ff=D_FF, activation="silu", rngs=nnx.Rngs(0))


class _Recording:
  """lecun_normal, recording the shapes it is called with."""

  def __init__(self):
    self.shapes = []

  def __call__(self, key, shape, dtype):
    self.shapes.append(tuple(shape))
    return nn.initializers.lecun_normal()(key, shape, dtype)


@pytest.mark.slow  # an eager NNX init of its own (~10 s on 2 cores); CI's second step runs it
@pytest.mark.parametrize("activation", ["geglu", "relu"])
def test_layers_take_activation_and_kernel_init(activation):
  """Both layers: a plain expert has no w_up_EDF; kernel_init is called on the router's [D, E] and on one expert's
  [D, F] or [F, D] at a time (each expert from its own key), so lecun_normal sees one expert's fan-in; the NNX
  layer matches the oracle with its activation (the Linen layer's init runs the same block)."""
  mesh = mesh_of((2, 4), DATA_EXPERT)
  x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 6, D_MODEL)), jnp.float32)
  sizes = dict(num_experts=EXPERTS, top_k=TOP_K, d_ff=D_FF, mesh=mesh, activation=activation)
  gated = activation in activations.GATED
  names = {"router_DE", "w_gate_EDF", "w_down_EFD"} | ({"w_up_EDF"} if gated else set())
  called_with = sorted([(D_MODEL, EXPERTS), (D_MODEL, D_FF), (D_FF, D_MODEL)] + [(D_MODEL, D_FF)] * gated)

  init = _Recording()
  layer = rm.nnx.MoE(D_MODEL, **sizes, kernel_init=init, rngs=nnx.Rngs(0))
  assert set(layer.names) == names and sorted(init.shapes) == called_with
  w_gate = np.asarray(layer.w_gate_EDF[...])
  assert np.std(w_gate) == pytest.approx(D_MODEL ** -0.5, rel=0.1)  # not (E·D)^-0.5
  assert not np.allclose(w_gate[0], w_gate[1])
  rmt.assert_layer_matches_dense_oracle(layer, x, rtol=F32_RTOL)

  init = _Recording()
  linen = rm.linen.MoE(**sizes, kernel_init=init)
  variables = jax.jit(linen.init)(jax.random.key(0), x)
  assert set(variables["params"]) == names and sorted(init.shapes) == called_with
  assert np.std(np.asarray(nn.unbox(variables["params"]["w_down_EFD"]))) == pytest.approx(D_FF ** -0.5, rel=0.1)
  with pytest.raises(ValueError, match="init_scale=0.5 scales the default initializer; with kernel_init="):
    rm.nnx.MoE(D_MODEL, **sizes, init_scale=0.5, kernel_init=init, rngs=nnx.Rngs(0))
