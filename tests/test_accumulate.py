"""Gradient accumulation: the whole batch's loss, router losses and every gradient from micro-batches (float32,
1e-5), and the load-balancing loss over the whole batch, not a mean over micro-batches."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import assert_close, requires_devices
from models.qwen3 import model as qwen3
from models.qwen3.config import load_config
from models.runtime import RuntimeConfig
from train.accumulate import accumulated_value_and_grad, micro_batches_of
from train.data import batches as train_data
from train.data.batches import SyntheticLanguage
from train.mesh import build_mesh, global_batch
from train.config import MeshConfig
from train.step import loss_fn

F32 = RuntimeConfig(dtype="float32", dispatcher="dense")  # the MoE math is not what is tested: the fastest compile


@functools.lru_cache(maxsize=None)
def _setup(router_aux_loss_coef, documents=False):
  requires_devices(8)
  mesh = build_mesh(MeshConfig(data=2, expert=4))
  # A coefficient of 1 and z-loss make the router losses' share of every gradient large enough to see.
  config = load_config("tiny", router_aux_loss_coef=router_aux_loss_coef, router_z_loss_coef=0.01)
  graphdef, state = nnx.split(qwen3.create_sharded(config, mesh, seed=3, runtime=F32))
  params = nnx.to_pure_dict(state)
  tokens_BS1 = np.random.default_rng(0).integers(0, config.vocab_size, (16, 17))
  if documents:  # an end of document (id 0) in every other row of one micro-batch: the micro-batches count apart
    tokens_BS1[tokens_BS1 == 0] = 1
    tokens_BS1[0::4, 5] = 0
  batch = train_data.documents(tokens_BS1, 0 if documents else None)
  return config, graphdef, params, global_batch(batch, mesh, F32)


def _whole_and_accumulated(router_aux_loss_coef, micro_batches=2, documents=False):
  config, graphdef, params, tokens = _setup(router_aux_loss_coef, documents)
  whole = jax.jit(lambda p, t: jax.value_and_grad(loss_fn, has_aux=True)(p, graphdef, t, config))(params, tokens)
  accumulated = jax.jit(lambda p, t: accumulated_value_and_grad(loss_fn, p, graphdef, t, config, micro_batches))(
      params, tokens)
  return whole, accumulated


@pytest.mark.slow  # compiles the model's gradient twice (~40 s on 2 cores); CI's second step runs it
@pytest.mark.parametrize("coef, documents", [(1.0, False), (0.0, False), (1.0, True)])
def test_accumulated_step_equals_the_whole_batch(coef, documents):
  """Loss, ce, load-balancing and z-loss, every gradient (router included) and the per-layer pair counts of two
  micro-batches equal one step over the whole batch (float32, 1e-5); with packed documents too, whose dropped
  targets leave the micro-batches different counts."""
  ((loss, parts), grads), ((acc_loss, acc_parts), acc_grads) = _whole_and_accumulated(coef, documents=documents)
  for name, a, b in (("loss", acc_loss, loss), *((k, acc_parts[k], parts[k]) for k in
                                                 ("ce", "load_balancing_loss", "router_z_loss"))):
    assert abs(float(a) - float(b)) <= 1e-5 * abs(float(b)), (name, float(a), float(b))
  assert float(parts["load_balancing_loss"]) > 1.0  # ~K = 2 at init: the comparison is not of zeros
  assert_close(acc_grads, grads, 1e-5, "gradients")
  np.testing.assert_array_equal(acc_parts["moe"].router.expert_counts_E, parts["moe"].router.expert_counts_E)
  assert_close(acc_parts["moe"].router, parts["moe"].router, 1e-5, "per-layer routing")
  assert int(jnp.sum(parts["moe"].router.expert_counts_E)) == 2 * 16 * 16 * 2  # layers × tokens × top-k


@pytest.mark.slow  # compiles the model's gradient three times (~60-90 s on 2 cores)
def test_per_micro_batch_load_balancing_would_differ():
  """What the accumulation avoids: the mean of the micro-batches' own load-balancing losses is not the whole
  batch's (f and P multiply), by far more than the tolerance above, and neither is its router gradient."""
  config, graphdef, params, tokens = _setup(1.0)
  ((_, parts), grads), _ = _whole_and_accumulated(1.0)
  halves = micro_batches_of(tokens["tokens"], 2)
  naive = [jax.jit(lambda p, t: jax.value_and_grad(loss_fn, has_aux=True)(p, graphdef, t, config))(
      params, {"tokens": t}) for t in halves]
  naive_lb = sum(float(parts_m["load_balancing_loss"]) for (_, parts_m), _ in naive) / 2
  assert abs(naive_lb - float(parts["load_balancing_loss"])) > 1e-4 * float(parts["load_balancing_loss"])
  naive_grads = jax.tree.map(lambda a, b: (a + b) / 2, naive[0][1], naive[1][1])
  naive_router, router = (g["layers"][0]["stacked"]["mlp"]["router_DE"] for g in (naive_grads, grads))
  err = float(jnp.max(jnp.abs(naive_router - router)) / jnp.max(jnp.abs(router)))
  assert err > 1e-4, err


def test_micro_batches_weigh_their_cross_entropy_by_their_counted_targets():
  """Default-run version of the documents case above, on one device and one layer (no load-balancing loss, so no
  counting pass): micro-batches holding different numbers of counted targets (EOS in two rows of one) still give
  the whole batch's cross-entropy and gradients, which a plain mean over micro-batches would not."""
  mesh = build_mesh(MeshConfig(data=1, expert=1), jax.devices()[:1])
  config = load_config("tiny", num_hidden_layers=1, router_aux_loss_coef=0.0, router_z_loss_coef=0.0)
  graphdef, state = nnx.split(qwen3.create_sharded(config, mesh, seed=3, runtime=F32))
  params = nnx.to_pure_dict(state)
  tokens_BS1 = np.random.default_rng(0).integers(1, config.vocab_size, (4, 17))
  tokens_BS1[0, 2:16:2] = 0  # row 0 (micro-batch 0 of 2) loses 7 of its 16 targets
  batch = global_batch(train_data.documents(tokens_BS1, 0), mesh, F32)
  (loss, parts), grads = jax.jit(lambda p, t: jax.value_and_grad(loss_fn, has_aux=True)(p, graphdef, t, config))(
      params, batch)
  (acc_loss, acc_parts), acc_grads = jax.jit(
      lambda p, t: accumulated_value_and_grad(loss_fn, p, graphdef, t, config, 2))(params, batch)
  assert abs(float(acc_parts["ce"]) - float(parts["ce"])) <= 1e-5 * float(parts["ce"])
  assert abs(float(acc_loss) - float(loss)) <= 1e-5 * float(loss)
  assert_close(acc_grads, grads, 1e-5, "gradients")


def test_micro_batches_take_every_shards_rows_evenly():
  tokens = np.arange(8 * 3).reshape(8, 3)
  micro = np.asarray(micro_batches_of(jnp.asarray(tokens), 4))
  assert micro.shape == (4, 2, 3)
  np.testing.assert_array_equal(micro[1], tokens[[1, 5]])
  np.testing.assert_array_equal(np.sort(micro.reshape(-1, 3), axis=0), tokens)
