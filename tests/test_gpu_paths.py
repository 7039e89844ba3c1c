"""Every path that runs on a Hopper GPU, run on one (`pytest -m gpu`): each dispatcher's forward and gradients on
the Mosaic kernels against `xla`, at a row count below both kernels' switch-overs (JAX's
`ragged_dot` and `transposed_ragged_dot` kernels run) and one at or above both (ours run), inside shard_map on a
1-device mesh with `data` and `expert` axes, where a kernel's output comes back typed invariant; one train step
of a small model per dispatcher, with and without context parallelism, against the dense dispatcher's; and the
`all_but_attention` remat keeping cuDNN's attention forward.

Tolerances (max |a − b| / max |b|): bf16 layers against each other ≤ 3e-2 (each is ~1e-2 from exact); a train
step's loss ≤ 1e-2 of the dense dispatcher's and each parameter's gradient ≤ 3e-2, leaf by leaf, in bf16.
"""

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import relaymoe_jax.testing as rmt
from conftest import mesh_of
from models.qwen3 import model as qwen3
from models.qwen3.config import load_config
from models.runtime import RuntimeConfig
from relaymoe_jax.kernels import grouped_matmul as gm, hopper_grouped, hopper_weight_grad
from test_equivalence import BF16_RTOL, DATA_EXPERT
from train.config import MeshConfig, OptimConfig
from train.data.batches import SyntheticLanguage, next_token_inputs
from train.mesh import build_mesh, global_batch
from train.step import TrainState, make_optimizer, make_train_step

pytestmark = pytest.mark.gpu

D_MODEL, D_FF, EXPERTS, TOP_K = 256, 256, 8, 2
# Rows reaching a grouped matmul on one device are T·K for every dispatcher: below both switch-overs, and at both.
ROWS = {"jax_kernels": 8192, "our_kernels": max(hopper_grouped.MIN_ROWS, hopper_weight_grad.MIN_ROWS)}
DISPATCHERS = {
    "ring_expert": ("ring_expert", {}),
    "ring_expert_keep_gate_up": ("ring_expert", {"keep_gate_up": True}),
    "ring_token": ("ring_token", {}),
    "auto": ("auto", {}),
    "all_to_all": ("all_to_all", {}),
    "all_to_all_cf1": ("all_to_all", {"capacity_factor": 1.0}),
}


@pytest.fixture(autouse=True)
def _hopper():
  if not gm._hopper(jax.devices()[0]):
    pytest.skip("the Mosaic GPU kernels need a Hopper GPU; run `pytest -m gpu` there")


@functools.lru_cache(maxsize=None)
def _layer(regime):
  return rmt.random_moe_inputs(31, ROWS[regime] // TOP_K, D_MODEL, D_FF, EXPERTS, TOP_K, dtype=jnp.bfloat16)


@functools.lru_cache(maxsize=None)
def _on_xla(regime):
  """The expert ring on `xla`: on one device every dispatcher computes the same sums (each equals the float32
  oracle on CPU, `test_equivalence`), so one reference per row count serves all."""
  return rmt.values_and_grads(_layer(regime), mesh=mesh_of((1, 1), DATA_EXPERT), dispatcher="ring_expert",
                              backend="xla")


@pytest.mark.parametrize("regime", sorted(ROWS))
@pytest.mark.parametrize("name", sorted(DISPATCHERS))
def test_dispatcher_on_mosaic_kernels_matches_xla(name, regime, caplog):
  """Output and the gradients of x, router weights and every expert weight, with no fallback to xla logged (the
  kernels ran); a capacity factor of 1.0 drops nothing on one device."""
  assert hopper_weight_grad.takes(ROWS[regime], D_MODEL, 2 * D_FF, jnp.bfloat16) == (regime == "our_kernels")
  assert hopper_grouped.takes(ROWS[regime], D_MODEL, 2 * D_FF, jnp.bfloat16) == (regime == "our_kernels")
  dispatcher, options = DISPATCHERS[name]
  with caplog.at_level(logging.WARNING):
    actual = rmt.values_and_grads(_layer(regime), mesh=mesh_of((1, 1), DATA_EXPERT), dispatcher=dispatcher,
                                  backend="mosaic_gpu", **options)
  assert "falls back" not in caplog.text and "does not apply" not in caplog.text, caplog.text
  rmt.assert_trees_close(actual, _on_xla(regime), BF16_RTOL)


@pytest.mark.parametrize("regime", sorted(ROWS))
@pytest.mark.parametrize("activation, options", [("geglu", {}), ("gelu", {"keep_gate_up": True})])
def test_other_activations_on_mosaic_kernels_match_xla(activation, options, regime, caplog):
  """GeGLU and a plain two-matrix GELU expert: the SwiGLU epilogue does not apply (its logged reason: CPU tests), so
  the plain kernels run the input projection and the activation runs after it; no fallback to xla."""
  inputs = rmt.random_moe_inputs(31, ROWS[regime] // TOP_K, D_MODEL, D_FF, EXPERTS, TOP_K, dtype=jnp.bfloat16,
                                 activation=activation)
  run = functools.partial(rmt.values_and_grads, inputs, mesh=mesh_of((1, 1), DATA_EXPERT), dispatcher="ring_expert",
                          activation=activation, **options)
  with caplog.at_level(logging.WARNING):
    actual = run(backend="mosaic_gpu")
  assert "falls back to xla" not in caplog.text, caplog.text
  rmt.assert_trees_close(actual, run(backend="xla"), BF16_RTOL)


def test_dense_dispatcher_matches_the_expert_ring():
  """The oracle itself on the GPU, in bf16, on the same mesh: against the expert ring on `xla`."""
  actual = rmt.values_and_grads(_layer("jax_kernels"), mesh=mesh_of((1, 1), DATA_EXPERT), dispatcher="dense")
  rmt.assert_trees_close(actual, _on_xla("jax_kernels"), BF16_RTOL)


def _small_model():
  """The tiny config, one layer, widened to widths the Mosaic kernels take (D and F multiples of 256)."""
  return dataclasses.replace(load_config("tiny"), vocab_size=512, hidden_size=D_MODEL, intermediate_size=512,
                             moe_intermediate_size=D_FF, head_dim=64, num_hidden_layers=1)


def _first_step(dispatcher, options, context_parallel, remat="none"):
  """The jitted train step and its first state and batch (4 × 512 tokens, bf16) on the trainer's mesh of one
  device."""
  model_config = _small_model()
  runtime = RuntimeConfig(dispatcher=dispatcher, dispatcher_options=options, context_parallel=context_parallel,
                          remat=remat)
  mesh = build_mesh(MeshConfig(data=1, expert=1, tensor=1), jax.devices()[:1])
  graphdef, params = nnx.split(qwen3.create_sharded(model_config, mesh, runtime=runtime))
  params = nnx.to_pure_dict(params)
  optimizer, schedule = make_optimizer(OptimConfig(), 10)
  tokens = global_batch({"tokens": SyntheticLanguage(model_config.vocab_size, 4, 0).batch(0, 4, 512)}, mesh, runtime)
  step = jax.jit(make_train_step(graphdef, optimizer, schedule, model_config))
  return step, TrainState(params, optimizer.init(params), jnp.zeros((), jnp.int32)), tokens


@functools.lru_cache(maxsize=None)
def _one_step(dispatcher, options, context_parallel, remat="none"):
  """(loss, grad_norm) of the first train step."""
  step, state, tokens = _first_step(dispatcher, options, context_parallel, remat)
  _, metrics = step(state, tokens)
  return float(metrics["loss"]), float(metrics["grad_norm"])


def test_all_but_attention_keeps_cudnns_attention_forward():
  """`all_but_attention` saves what cuDNN's attention forward made: the compiled step runs that kernel once (where
  `layer` runs it again in backward), and the step computes what keeping everything does."""
  def kernels(remat):
    step, state, tokens = _first_step("ring_expert", (), False, remat)
    hlo = step.lower(state, tokens).compile().as_text()
    return [hlo.count(f'custom_call_target="__cudnn$fmhaSoftmax{kind}"') for kind in ("", "Backward")]

  assert kernels("layer") == [2, 1] and kernels("all_but_attention") == [1, 1]
  loss, grad_norm = _one_step("ring_expert", (), False, "all_but_attention")
  loss_ref, grad_norm_ref = _one_step("ring_expert", (), False)
  assert abs(loss - loss_ref) <= 1e-3 * loss_ref and abs(grad_norm - grad_norm_ref) <= 1e-2 * grad_norm_ref


@functools.lru_cache(maxsize=None)
def _gradients(dispatcher, options, context_parallel):
  """(loss, the gradient of every parameter, float32 on the host) of the train step's loss on its first batch,
  the parameters the same for every dispatcher (one seed)."""
  runtime = RuntimeConfig(dispatcher=dispatcher, dispatcher_options=options, context_parallel=context_parallel)
  mesh = build_mesh(MeshConfig(data=1, expert=1, tensor=1), jax.devices()[:1])
  graphdef, params = nnx.split(qwen3.create_sharded(_small_model(), mesh, runtime=runtime))
  batch = global_batch({"tokens": SyntheticLanguage(_small_model().vocab_size, 4, 0).batch(0, 4, 512)}, mesh, runtime)
  inputs, labels, _ = next_token_inputs(batch)

  def loss(params):
    return nnx.merge(graphdef, params).mean_cross_entropy_and_aux(inputs, labels)[0]

  value, grads = jax.jit(jax.value_and_grad(loss))(nnx.to_pure_dict(params))
  return float(value), jax.tree.map(lambda g: np.asarray(g, np.float32), grads)


@pytest.mark.parametrize("context_parallel", [False, True], ids=["plain", "context_parallel"])
@pytest.mark.parametrize("name", sorted(DISPATCHERS))
def test_train_step_of_each_dispatcher_matches_dense(name, context_parallel):
  """The loss and every parameter's gradient, leaf by leaf (max |a − b| / max |b| ≤ 3e-2 in bf16): a wrong
  dispatcher that still trains (two experts swapped, a flipped router) moves whole leaves by far more."""
  dispatcher, options = DISPATCHERS[name]
  loss, grads = _gradients(dispatcher, tuple(options.items()), context_parallel)
  loss_ref, grads_ref = _gradients("dense", (), context_parallel)
  assert np.isfinite(loss) and abs(loss - loss_ref) <= 1e-2 * loss_ref, (loss, loss_ref)
  rmt.assert_trees_close(grads, grads_ref, BF16_RTOL)
