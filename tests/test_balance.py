"""Expert-load statistics against hand counts, the router's entropy, and auxiliary-loss-free balancing: the bias
chooses experts without weighing them, takes no gradient, evens a skewed router's load over steps, and at zero
changes nothing."""

import jax
import jax.numpy as jnp
import numpy as np

import relaymoe_jax as rm


def test_load_statistics_match_hand_counts():
  counts = jnp.array([[4, 0, 2, 2], [2, 2, 2, 2], [0, 0, 0, 0]], jnp.int32)
  stats = jax.tree.map(np.asarray, rm.expert_load_stats(counts))
  np.testing.assert_allclose(stats["max_over_mean"], [2.0, 1.0, 0.0])
  np.testing.assert_allclose(stats["min_over_mean"], [0.0, 1.0, 0.0])
  np.testing.assert_allclose(stats["cv"], [np.sqrt(2) / 2, 0.0, 0.0], rtol=1e-6)  # std([4,0,2,2]) = √2
  np.testing.assert_array_equal(stats["dead"], [1, 0, 4])


def test_router_statistics_of_route_match_numpy():
  """Pair counts and the mean entropy of the router distribution, from `route`, against numpy."""
  rng = np.random.default_rng(0)
  x, router = rng.normal(size=(32, 8)).astype(np.float32), rng.normal(size=(8, 6)).astype(np.float32)
  idx, _, aux = rm.route(jnp.asarray(x), jnp.asarray(router), top_k=2)
  logits = (x.astype(np.float64) @ router)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  np.testing.assert_array_equal(aux.expert_counts_E, np.bincount(np.argsort(-p, -1)[:, :2].ravel(), minlength=6))
  np.testing.assert_allclose(float(aux.entropy), np.mean(-np.sum(p * np.log(p), -1)), rtol=1e-5)
  uniform = rm.route(jnp.asarray(x), jnp.zeros((8, 6)), top_k=2)[2]
  np.testing.assert_allclose(float(uniform.entropy), np.log(6), rtol=1e-6)


def test_update_moves_the_bias_against_the_load():
  bias = rm.update_router_bias(jnp.zeros(4), jnp.array([3, 1, 2, 2]), 0.1)
  np.testing.assert_allclose(bias, [-0.1, 0.1, 0.0, 0.0])
  layers = rm.update_router_bias(jnp.ones((2, 3)), jnp.array([[0, 0, 6], [2, 2, 2]]), 0.5)
  np.testing.assert_allclose(layers, [[1.5, 1.5, 0.5], [1.0, 1.0, 1.0]])


def _skewed():
  """Tokens with a constant feature the router weighs unevenly per expert: experts 0 and 1 favoured, 6 and 7
  shunned (expert 7 gets no token)."""
  rng = np.random.default_rng(1)
  x = rng.normal(size=(512, 16))
  x[:, 0] = 1.0
  router = rng.normal(size=(16, 8)) * 0.3
  router[0] = [2.5, 2.0, 0, 0, 0, 0, -1.5, -3]
  return jnp.asarray(x, jnp.float32), jnp.asarray(router, jnp.float32)


def test_bias_chooses_experts_but_weights_stay_unbiased():
  x, router = _skewed()
  bias = jnp.array([-1.0, -1.0, 0, 0, 0, 0, 0.5, 0])
  idx, w, aux = rm.route(x, router, top_k=2, norm_topk_prob=False, bias_E=bias)
  probs = np.asarray(jax.nn.softmax(x @ router, axis=-1))
  np.testing.assert_array_equal(np.sort(idx, -1), np.sort(np.argsort(-(probs + np.asarray(bias)), -1)[:, :2], -1))
  np.testing.assert_allclose(w, np.take_along_axis(probs, np.asarray(idx), -1), rtol=1e-6)
  np.testing.assert_array_equal(aux.expert_counts_E, np.bincount(np.asarray(idx).ravel(), minlength=8))
  grad_bias, grad_router = jax.grad(lambda b, r: jnp.sum(rm.route(x, r, top_k=2, bias_E=b)[1] ** 2)
                                    + rm.route(x, r, top_k=2, bias_E=b)[2].load_balancing_loss,
                                    argnums=(0, 1))(bias, router)
  assert not np.any(np.asarray(grad_bias)) and np.any(np.asarray(grad_router))


def test_a_zero_bias_routes_bit_for_bit_as_none():
  x, router = _skewed()
  plain = rm.route(x, router, top_k=2)
  biased = rm.route(x, router, top_k=2, bias_E=jnp.zeros(8))
  for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(biased)):
    np.testing.assert_array_equal(a, b)


def test_loss_free_balancing_evens_a_skewed_router():
  """The update rule on a skewed router: the coefficient of variation of the load falls from 1.3 to about a
  quarter of it within 60 steps (where the sign update oscillates), and no expert stays dead; at rate 0 the load
  does not move."""
  x, router = _skewed()

  @jax.jit
  def step(bias, rate):
    counts = rm.route(x, router, top_k=2, bias_E=bias)[2].expert_counts_E
    return rm.update_router_bias(bias, counts, rate), rm.expert_load_stats(counts)

  def run(rate, steps=60):
    bias, history = jnp.zeros(8), []
    for _ in range(steps):
      bias, stats = step(bias, rate)
      history.append(stats)
    return history

  balanced, frozen = run(1e-2), run(0.0)
  first, last = float(balanced[0]["cv"]), float(np.mean([float(s["cv"]) for s in balanced[-10:]]))
  assert first > 1.0, first  # skewed to begin with
  assert last < 0.35 * first, (first, last)
  assert int(balanced[-1]["dead"]) == 0 and int(balanced[0]["dead"]) > 0
  assert all(float(s["cv"]) == first for s in frozen)
