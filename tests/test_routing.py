"""`route` against a NumPy transcription of Qwen3's router (softmax in float32, top-k, renormalise) and of Hugging
Face's load-balancing loss."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import relaymoe_jax as rm


def numpy_route(x, router, top_k, norm, logits=None):
  logits = x.astype(np.float64) @ router.astype(np.float64) if logits is None else logits.astype(np.float64)
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  idx = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
  w = np.take_along_axis(probs, idx, -1)
  if norm:
    w = w / w.sum(-1, keepdims=True)
  num_e = logits.shape[1]
  mask = np.eye(num_e)[idx]  # [T, K, E], as HF's one_hot(selected_experts)
  lb = num_e * np.sum(mask.mean(0) * probs.mean(0)[None])
  lse = np.log(np.exp(logits).sum(-1))
  return idx, w, lb, mask.sum((0, 1)), np.mean(lse ** 2)


@pytest.mark.parametrize("top_k,norm", [(1, False), (2, True), (8, True), (8, False)])
def test_route_matches_numpy(top_k, norm):
  rng = np.random.default_rng(top_k)
  x, router = rng.normal(size=(48, 12)).astype(np.float32), rng.normal(size=(12, 16)).astype(np.float32)
  idx, w, aux = rm.route(jnp.asarray(x), jnp.asarray(router), top_k=top_k, norm_topk_prob=norm)
  idx_ref, w_ref, lb_ref, counts_ref, z_ref = numpy_route(x, router, top_k, norm)
  assert idx.dtype == jnp.int32 and w.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(idx), idx_ref)
  np.testing.assert_allclose(np.asarray(w), w_ref, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(float(aux.load_balancing_loss), lb_ref, rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(aux.expert_counts_E), counts_ref)
  np.testing.assert_allclose(float(aux.z_loss), z_ref, rtol=1e-4)


def test_load_balancing_loss_over_layers_concatenates_them_as_hugging_face():
  """HF's load_balancing_loss_func takes every layer's router logits concatenated along tokens; layers that route
  differently give a different value from the mean of per-layer losses."""
  rng = np.random.default_rng(5)
  x = rng.normal(size=(40, 12)).astype(np.float32)
  routers = [rng.normal(size=(12, 16)).astype(np.float32) * s for s in (0.5, 2.0, 4.0)]
  auxes = [rm.route(jnp.asarray(x), jnp.asarray(r), top_k=4)[2] for r in routers]
  lb_concat = numpy_route(np.concatenate([x] * 3), None, 4, True, logits=np.concatenate([x @ r for r in routers]))[2]
  np.testing.assert_allclose(float(rm.load_balancing_loss(auxes)), lb_concat, rtol=1e-5)
  per_layer_mean = np.mean([float(a.load_balancing_loss) for a in auxes])
  assert abs(per_layer_mean - lb_concat) > 1e-3 * lb_concat


def test_load_balancing_loss_takes_stacked_layers_as_their_list():
  """A scanned model's aux holds f and P as [L, E] (`nn.scan` / `nnx.scan` stack them): the loss of the list of its
  layers, not E taken as L; a rank it cannot read is refused by name."""
  rng = np.random.default_rng(6)
  x = jnp.asarray(rng.normal(size=(40, 12)).astype(np.float32))
  auxes = [rm.route(x, jnp.asarray(rng.normal(size=(12, 16)).astype(np.float32) * s), top_k=4)[2]
           for s in (0.5, 2.0, 4.0)]
  stacked = jax.tree.map(lambda *a: jnp.stack(a), *auxes)
  expected = float(rm.load_balancing_loss(auxes))
  np.testing.assert_allclose(float(rm.load_balancing_loss(stacked)), expected, rtol=1e-6)
  np.testing.assert_allclose(float(rm.load_balancing_loss([stacked])), expected, rtol=1e-6)
  two_scans = [jax.tree.map(lambda *a: jnp.stack(a), *auxes[:2]), auxes[2]]
  np.testing.assert_allclose(float(rm.load_balancing_loss(two_scans)), expected, rtol=1e-6)
  with pytest.raises(ValueError, match=r"auxes\[0\]: fraction_E \(1, 3, 16\)"):
    rm.load_balancing_loss(jax.tree.map(lambda a: a[None], stacked))


def test_load_balancing_loss_is_k_under_uniform_router():
  """All-equal logits: P_e = 1/E and f_e = K/E, so E · Σ f·P = K, HF's value for perfectly balanced routing."""
  x = jnp.ones((32, 4))
  _, _, aux = rm.route(x, jnp.zeros((4, 8)), top_k=2)
  np.testing.assert_allclose(float(aux.load_balancing_loss), 2.0, rtol=1e-6)


@pytest.mark.slow  # ~6 s; the default run reached 9.6 min on 2 cores, over 10 on CI's; CI's second step runs it
def test_route_keeps_bfloat16_and_is_differentiable():
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(16, 8)), jnp.bfloat16)
  router = jnp.asarray(rng.normal(size=(8, 4)), jnp.bfloat16)
  _, w, _ = rm.route(x, router, top_k=2)
  assert w.dtype == jnp.bfloat16
  g = jax.grad(lambda r: jnp.sum(rm.route(x, r, top_k=2)[1].astype(jnp.float32) ** 2) +
               rm.route(x, r, top_k=2)[2].load_balancing_loss)(router)
  assert g.dtype == jnp.bfloat16 and float(jnp.max(jnp.abs(g.astype(jnp.float32)))) > 0


def test_route_on_zero_tokens_gives_zero_losses():
  """No tokens: empty routing, and statistics and losses of 0 (finite gradients), not the NaN of a mean over none."""
  router = jnp.ones((3, 8))
  idx, w, aux = rm.route(jnp.ones((0, 3)), router, top_k=2)
  assert idx.shape == w.shape == (0, 2)
  for name, value in aux._asdict().items():
    np.testing.assert_array_equal(np.asarray(value), 0, err_msg=name)

  def losses(router_DE):
    aux = rm.route(jnp.ones((0, 3)), router_DE, top_k=2)[2]
    return aux.load_balancing_loss + aux.z_loss

  np.testing.assert_array_equal(np.asarray(jax.grad(losses)(router)), 0)
  np.testing.assert_array_equal(float(rm.load_balancing_loss([aux, aux])), 0)
