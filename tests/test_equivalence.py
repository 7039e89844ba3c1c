"""Every sharded dispatcher against the dense float32 oracle: outputs and gradients w.r.t. x, w_TK and every expert
weight, on random data, uniform and skewed routing, over ring sizes 1–8 and ('expert',) / ('data', 'expert') meshes,
through the public `relaymoe_jax.testing` check; out-of-range expert ids under jit, zero tokens, and one trace for
any routing of the same shapes.

Tolerances (max |a − b| / max |b|): float32 ≤ 1e-5; bfloat16 inputs ≤ 3e-2 against the oracle run in float32 on
the same bf16-rounded inputs.
"""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import relaymoe_jax as rm
import relaymoe_jax.testing as rmt
from conftest import assert_close, mesh_of, random_layer
from relaymoe_jax.ring import hop
from relaymoe_jax.layout import varying_zeros
from relaymoe_jax.ring.schedule import ring_relay, ring_relay_homeward
from relaymoe_jax.ring.vjp import make_ring_spec

F32_RTOL = 1e-5
BF16_RTOL = 3e-2
TOKENS, D_MODEL, D_FF = 64, 16, 24
DIFF_ARGS = rmt.DIFF_ARGS

E_ONLY, DATA_EXPERT = (rm.EXPERT,), (rm.DATA, rm.EXPERT)
ETP_NAMES = (rm.DATA, rm.EXPERT, rm.TENSOR)
# (mesh shape, axis names, E, K, skewed routing, chunk_rows: one size or a ladder)
CASES = [
    ((1,), E_ONLY, 8, 2, False, None),
    ((2,), E_ONLY, 16, 8, True, None),
    ((4,), E_ONLY, 8, 1, False, None),
    ((8,), E_ONLY, 64, 8, False, None),
    ((8,), E_ONLY, 8, 2, True, (8, 3)),
    ((8,), E_ONLY, 16, 8, True, None),
    ((2, 4), DATA_EXPERT, 16, 2, False, None),
    ((4, 2), DATA_EXPERT, 64, 8, True, (16, 4)),
    ((2, 4), DATA_EXPERT, 8, 1, True, 4),
]


def _case_id(case):
  shape, names, e, k, skew, rows = case
  return f"{'x'.join(map(str, shape))}{'-dp' if len(names) > 1 else ''}-E{e}-K{k}-{'skew' if skew else 'unif'}" + (
      f"-R{'-'.join(map(str, rows)) if isinstance(rows, tuple) else rows}" if rows else "")


def assert_matches_oracle(layer, mesh, rtol, dispatcher, **options):
  """The public `relaymoe_jax.testing.assert_matches_dense_oracle`, so every case here exercises it."""
  rmt.assert_matches_dense_oracle(mesh=mesh, dispatcher=dispatcher, rtol=rtol, **layer, **options)


@pytest.mark.parametrize("dispatcher", ["ring_expert", "ring_token", "all_to_all"])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_float32_matches_oracle(case, dispatcher):
  """Values and every gradient against the dense float32 oracle. Mutants killed in the all-to-all's row moves
  (`row_maps`, with the ETP and capacity tests beside this one): a slot's offset not counted from its destination's
  first pair; expand's backward summing one of the K pairs; combine's backward without the router weight, or its
  router-weight gradient not summed over the tensor axis; the receiver's inverse permutation replaced by the
  permutation."""
  shape, names, e, k, skew, rows = case
  layer = random_layer(sum(shape) + e + k, TOKENS, D_MODEL, D_FF, e, k, skew=skew)
  options = {"chunk_rows": rows} if (rows and dispatcher.startswith("ring")) else {}
  assert_matches_oracle(layer, mesh_of(shape, names), F32_RTOL, dispatcher, **options)


@pytest.mark.parametrize("dispatcher", ["ring_expert", "ring_token", "all_to_all"])
@pytest.mark.parametrize("skew", [False, True])
def test_bfloat16_matches_oracle(dispatcher, skew):
  layer = random_layer(7, TOKENS, D_MODEL, D_FF, 16, 4, skew=skew, dtype=jnp.bfloat16)
  assert_matches_oracle(layer, mesh_of((2, 4), DATA_EXPERT), BF16_RTOL, dispatcher)


def test_bfloat16_weight_gradients_summed_over_many_chunks_match_oracle():
  """The expert ring sums a hop's weight gradients over its chunks in the weights' dtype: with 16-row chunks
  (up to 16 per hop, skewed) the bf16 sums stay within the bf16 tolerance (max error 8e-3 here, as with f32 sums;
  at 512 tokens, 1e-2 against 5e-3)."""
  layer = random_layer(9, TOKENS, D_MODEL, D_FF, 16, 4, skew=True, dtype=jnp.bfloat16)
  assert_matches_oracle(layer, mesh_of((2,), E_ONLY), BF16_RTOL, "ring_expert", chunk_rows=16)


@pytest.mark.parametrize("dispatcher", ["ring_expert", "ring_token"])
def test_chunks_capped_by_max_chunk_rows_match_oracle(dispatcher):
  """`max_chunk_rows` caps the default ladder (what `train.plan.planner` does when memory is short): a skewed hop of up to
  512 rows walks 128-row chunks instead of one chunk of its share."""
  layer = random_layer(11, 512, D_MODEL, D_FF, 8, 2, skew=True)
  mesh = mesh_of((2,), E_ONLY)
  layout = rm.ExpertLayout(mesh)
  spec = make_ring_spec(layout, layer["x_TD"], layer["idx_TK"], layer["w_gate_EDF"], chunk_rows=None,
                        backend="xla", row_cap=128)
  assert spec.chunk_rows == (128,), spec.chunk_rows
  uncapped = make_ring_spec(layout, layer["x_TD"], layer["idx_TK"], layer["w_gate_EDF"], chunk_rows=None,
                            backend="xla")
  assert uncapped.chunk_rows[0] > 128, uncapped.chunk_rows
  assert_matches_oracle(layer, mesh, F32_RTOL, dispatcher, max_chunk_rows=128)


def test_ring_without_recompute_matches_oracle():
  """The autodiff ablation (same ring forward, plain reverse mode) computes the same function and gradients."""
  layer = random_layer(3, TOKENS, D_MODEL, D_FF, 16, 2)
  assert_matches_oracle(layer, mesh_of((2, 4), DATA_EXPERT), F32_RTOL, "ring_expert", recompute=False,
                        chunk_rows=8)


@pytest.mark.parametrize("shape, names, e, k, skew, options", [
    ((1,), E_ONLY, 8, 2, False, {}), ((2,), E_ONLY, 16, 8, True, {}), ((8,), E_ONLY, 8, 2, True, {"chunk_rows": (8, 3)}),
    ((4, 2), DATA_EXPERT, 64, 8, True, {"chunk_rows": (16, 4), "reverse_backward": True}),
    ((2, 2, 2), ETP_NAMES, 8, 2, True, {"tensor_axis": rm.TENSOR})])
def test_backward_keeping_gate_up_matches_oracle(shape, names, e, k, skew, options):
  """`keep_gate_up`: the forward writes x·[gate | up] of each hop's pairs into one buffer (chunks past a hop's range
  write nothing there, ranges visited in ring order), the backward reads it instead of recomputing."""
  layer = random_layer(sum(shape) + e + 5, TOKENS, D_MODEL, D_FF, e, k, skew=skew)
  assert_matches_oracle(layer, mesh_of(shape, names), F32_RTOL, "ring_expert", keep_gate_up=True, **options)


@pytest.mark.parametrize("dispatcher", ["ring_expert", "ring_token"])
@pytest.mark.parametrize("min_rows_per_token", [0, 10**9])
def test_rows_added_to_tokens_by_gather_or_scatter_match_oracle(monkeypatch, dispatcher, min_rows_per_token):
  """Every chunk adds its rows to their tokens by gather (0), or every chunk by scatter-add (10⁹): skewed ranges that
  start past 0, a ladder whose chunks reach past their range, and tokens with pairs in several hops."""
  monkeypatch.setattr(hop, "GATHER_MIN_ROWS_PER_TOKEN", min_rows_per_token)
  jax.clear_caches()  # traces made under the default rule must not be reused
  layer = random_layer(29, TOKENS, D_MODEL, D_FF, 16, 4, skew=True)
  assert_matches_oracle(layer, mesh_of((2, 2), DATA_EXPERT), F32_RTOL, dispatcher, chunk_rows=(16, 4))


def _scatters_into_tokens(dispatcher, ring, **options):
  """Whether the jitted fwd+bwd of a layer scatter-adds rows into a [T, D] array (T = 128 tokens per device)."""
  layer = random_layer(31, 128 * ring, D_MODEL, D_FF, 8, 2)
  mesh = mesh_of((ring,), E_ONLY)
  loss = lambda x, *w: jnp.sum(rm.moe_ffn(x, layer["idx_TK"], *w, mesh=mesh, dispatcher=dispatcher, **options))
  args = [layer[a] for a in ("x_TD", "w_TK", "w_gate_EDF", "w_up_EDF", "w_down_EFD")]
  text = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(*args))
  return bool(re.search(rf"f32\[128,{D_MODEL}\](\{{[^}}]*\}})? = scatter-add", text))  # {V:axes}: varying axes


def test_a_ring_of_one_adds_rows_to_tokens_by_gather():
  """A ring of one walks its T·K pairs as one chunk: each token sums its K rows (no float32 scatter-add, whose
  atomics were 6.8 of 15.3 ms of non-matmul kernels on one H200, `moe_layer` run 20); small chunks still scatter."""
  assert not _scatters_into_tokens("ring_expert", 1)
  assert _scatters_into_tokens("ring_expert", 2, chunk_rows=(64, 16))


@pytest.mark.parametrize("shape, names, e, k, skew", [
    ((1,), E_ONLY, 8, 2, False), ((2,), E_ONLY, 16, 8, True), ((3,), E_ONLY, 6, 2, True), ((3,), E_ONLY, 12, 4, False),
    ((8,), E_ONLY, 16, 8, False), ((2, 4), DATA_EXPERT, 16, 2, True)])
def test_reverse_backward_matches_oracle(shape, names, e, k, skew):
  """The expert ring's backward run the other way from the forward's last weights: the same gradients."""
  layer = random_layer(sum(shape) + e, 48, D_MODEL, D_FF, e, k, skew=skew)
  assert_matches_oracle(layer, mesh_of(shape, names), F32_RTOL, "ring_expert", reverse_backward=True)


@pytest.mark.parametrize("skew", [False, True])
def test_home_send_backward_on_a_ring_of_two_matches_oracle(skew):
  """A ring of two reverses its backward by default; the forward-order backward, asked for, stays exact."""
  layer = random_layer(11, 48, D_MODEL, D_FF, 16, 4, skew=skew)
  assert_matches_oracle(layer, mesh_of((2,), E_ONLY), F32_RTOL, "ring_expert", reverse_backward=False)


def _relay_on_ring(n, homeward):
  """Each device's result of a relay whose hop records the partition it is at (state: their base-N digits, in hop
  order) and contributes (payload × (r + 1), 1 if the payload is the partition's): payload r + 1 on device r."""

  def per_device(_):
    r = jax.lax.axis_index(rm.EXPERT)

    def compute(order_1, partition, payload_1):
      partial = (payload_1.astype(jnp.float32) * (r + 1), (payload_1 == partition + 1).astype(jnp.float32))
      return order_1 * n + partition, partial

    order0_1 = varying_zeros((1,), jnp.int32, (rm.EXPERT,))
    own_1 = varying_zeros((1,), jnp.int32, (rm.EXPERT,)) + r + 1
    relay = dict(axis=rm.EXPERT, n=n, to_relay=lambda a: a)
    if homeward:  # from device r + 1's payload, what `ring_pass` ends with
      order_1, (acc_1, seen_1) = ring_relay_homeward(compute, order0_1, (own_1 % n) + 1, home=own_1, **relay)
    else:
      order_1, (acc_1, seen_1) = ring_relay(compute, order0_1, own_1, **relay)
    return order_1, acc_1, seen_1

  spec = P(rm.EXPERT)
  f = jax.shard_map(per_device, mesh=mesh_of((n,), E_ONLY), in_specs=spec, out_specs=(spec, spec, spec))
  return [np.asarray(a) for a in jax.jit(f)(jnp.zeros(n))]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("homeward", [False, True], ids=["ring_relay", "ring_relay_homeward"])
def test_relay_schedules_visit_every_partition_and_bring_its_sum_home(n, homeward):
  """Device r visits partitions (r − h) mod N (`ring_relay`) or (r + 1 + h) mod N (`ring_relay_homeward`, what
  `ring_relay(..., home=)` was) at hop h, each with that partition's payload, and ends holding the sum over all N
  devices of its own partition's partials."""
  order, acc, seen = _relay_on_ring(n, homeward)
  for r in range(n):
    visits = [((r + 1 + h) if homeward else (r - h)) % n for h in range(n)]
    assert order[r] == sum(p * n ** (n - 1 - h) for h, p in enumerate(visits)), (r, order[r], visits)
  np.testing.assert_array_equal(acc, (np.arange(n) + 1) * n * (n + 1) / 2)
  np.testing.assert_array_equal(seen, np.full(n, n))


def test_reverse_backward_default_is_on_for_a_ring_of_two_only():
  assert [rm.RingExpert().reverses_backward(n) for n in (1, 2, 3, 8)] == [False, True, False, False]
  assert rm.RingExpert(reverse_backward=True).reverses_backward(8)
  assert not rm.RingExpert(reverse_backward=False).reverses_backward(2)
  assert not rm.RingExpert(recompute=False).reverses_backward(2)  # plain autodiff: no custom backward to reverse


def test_reverse_backward_sends_no_weights_on_a_ring_of_two():
  """Ring of two: the forward-order backward compiles to three sends of (gate+up, down)-sized pairs (forward
  weights, backward gradient relay and home return; XLA merges the backward's weight prefetch into the forward's),
  the reverse backward, the default there, to two (forward weights, one gradient send)."""
  layer = random_layer(5, 32, D_MODEL, D_FF, 8, 2)
  mesh = mesh_of((2,), E_ONLY)

  def sends(**options):
    def loss(x_TD, *diff):
      return jnp.sum(rm.moe_ffn(x_TD, layer["idx_TK"], *diff, mesh=mesh, dispatcher="ring_expert", **options) ** 2)

    step = jax.jit(jax.grad(loss, argnums=range(5)))
    hlo = step.lower(*(layer[a] for a in DIFF_ARGS)).compile().as_text()
    return len(re.findall(r"collective-permute(-start)?\(", hlo))  # GPUs compile the sends as async pairs

  assert (sends(reverse_backward=False), sends(), sends(reverse_backward=True)) == (6, 4, 4)


def _capacity_kept_weights(layer, ring_size, token_shards, capacity_factor):
  """w_TK with the pairs a capacity-bound all-to-all drops set to zero: per device, pairs sorted by expert (stable),
  and each destination keeps its first C = ceil(c·T·K/N) pairs."""
  idx, w = np.asarray(layer["idx_TK"]), np.array(layer["w_TK"], np.float32)
  num_l = layer["w_gate_EDF"].shape[0] // ring_size
  t_dev, k = idx.shape[0] // token_shards, idx.shape[1]
  slots = int(np.ceil(capacity_factor * t_dev * k / ring_size))
  for dev in range(token_shards):
    rows = slice(dev * t_dev, (dev + 1) * t_dev)
    flat_idx, flat_w = idx[rows].reshape(-1), w[rows].reshape(-1)
    order = np.argsort(flat_idx, kind="stable")
    dest = flat_idx[order] // num_l
    rank_in_dest = np.arange(order.size) - np.searchsorted(dest, dest)
    flat_w[order[rank_in_dest >= slots]] = 0.0
    w[rows] = flat_w.reshape(t_dev, k)
  return w


def test_capacity_factor_drops_overflow_like_gshard():
  mesh = mesh_of((8,), E_ONLY)
  layer = random_layer(11, TOKENS, D_MODEL, D_FF, 16, 4, skew=True)
  kept = dict(layer, w_TK=jnp.asarray(_capacity_kept_weights(layer, 8, 8, 1.0)))
  assert float(jnp.sum(kept["w_TK"] == 0)) > 0, "skewed routing must overflow capacity 1.0"
  y, grads = rmt.values_and_grads(layer, mesh=mesh, dispatcher="all_to_all", capacity_factor=1.0)
  y_kept, grads_kept = rmt.dense_oracle(kept, mesh=mesh)
  assert_close(y, y_kept, F32_RTOL, "y_TD with drops")
  for name in ("x_TD", "w_gate_EDF", "w_down_EFD"):  # a dropped pair sends no gradient either
    assert_close(grads[name], grads_kept[name], F32_RTOL, name)
  y_full, _ = rmt.dense_oracle(layer, mesh=mesh)
  assert float(jnp.max(jnp.abs(y - y_full))) > 1e-3, "dropped pairs must change the output"


def test_kept_gate_up_never_reads_unwritten_rows(monkeypatch):
  """The kept x·[gate | up] buffer starts uninitialised (`lax.empty`); here it starts as NaN. Pairs of no expert
  (ids out of range under jit) are written nowhere, and chunks reach past their hop's range: none of it may leak."""
  monkeypatch.setattr(jax.lax, "empty", lambda shape, dtype, **_: jnp.full(shape, jnp.nan, dtype))
  test_out_of_range_expert_ids_under_jit_contribute_nothing("ring_expert", {"keep_gate_up": True,
                                                                            "chunk_rows": (8, 3)})


ALL_DISPATCHERS = [("ring_expert", {}), ("ring_expert", {"reverse_backward": True}), ("ring_token", {}),
                   ("auto", {}), ("all_to_all", {}), ("dense", {})]
ALL_IDS = [name + "".join(f"-{k}" for k in options) for name, options in ALL_DISPATCHERS]
# (token, k) -> an expert id outside [0, 16): both pairs of token 3, and single pairs on other devices.
BAD_PAIRS = {(3, 0): -1, (3, 1): 16, (10, 1): -16, (20, 0): 2**31 - 1, (41, 1): -(2**31)}


@pytest.mark.parametrize("dispatcher, options", ALL_DISPATCHERS, ids=ALL_IDS)
def test_out_of_range_expert_ids_under_jit_contribute_nothing(dispatcher, options):
  """Traced ids outside [0, E) cannot be rejected; each such pair must add nothing to y, get a zero router-weight
  gradient and leave every other pair as it was: the oracle on the same inputs with those pairs' weights zeroed
  (their ids left valid), its router-weight gradient for them set to zero."""
  mesh = mesh_of((2, 4), DATA_EXPERT)
  layer = random_layer(24, TOKENS, D_MODEL, D_FF, 16, 2)  # the shapes of a CASES entry: compiled functions shared
  bad_TK = np.zeros(layer["idx_TK"].shape, bool)
  idx_TK = np.array(layer["idx_TK"])
  for (t, k), expert in BAD_PAIRS.items():
    bad_TK[t, k], idx_TK[t, k] = True, expert
  y, grads = rmt.values_and_grads(dict(layer, idx_TK=jnp.asarray(idx_TK)), mesh=mesh, dispatcher=dispatcher,
                                  **options)
  y_ref, grads_ref = rmt.dense_oracle(dict(layer, w_TK=jnp.where(bad_TK, 0.0, layer["w_TK"])), mesh=mesh)
  grads_ref["w_TK"] = jnp.where(bad_TK, 0.0, grads_ref["w_TK"])
  rmt.assert_trees_close(dict(y_TD=y, **grads), dict(y_TD=y_ref, **grads_ref), F32_RTOL)
  chex.assert_trees_all_equal(y[3], jnp.zeros_like(y[3]))  # both of its pairs out of range
  chex.assert_trees_all_equal(grads["w_TK"][bad_TK], jnp.zeros(len(BAD_PAIRS)))


@pytest.mark.parametrize("dispatcher, options", ALL_DISPATCHERS, ids=ALL_IDS)
def test_zero_tokens_give_an_empty_output(dispatcher, options):
  """Every dispatcher: y_TD [0, D], empty dx and d(router weight), zero expert-weight gradients."""
  mesh = mesh_of((2, 4), DATA_EXPERT)
  layer = random_layer(0, 0, D_MODEL, D_FF, 16, 2)
  y, grads = rmt.values_and_grads(layer, mesh=mesh, dispatcher=dispatcher, **options)
  chex.assert_trees_all_equal_shapes_and_dtypes((y, grads), (layer["x_TD"], {k: layer[k] for k in DIFF_ARGS}))
  weights = ("w_gate_EDF", "w_up_EDF", "w_down_EFD")
  chex.assert_trees_all_equal({k: grads[k] for k in weights}, {k: jnp.zeros_like(layer[k]) for k in weights})
  eager = rm.moe_ffn(*(layer[a] for a in rmt.MOE_ARGS), mesh=mesh, dispatcher=dispatcher, **options)
  assert y.shape == eager.shape == (0, D_MODEL)


def test_jitted_ring_traces_once_for_any_routing():
  """A hop's chunk count is data-dependent (while loops), so new routing of the same shapes, uniform and then
  skewed into one partition, runs the step compiled for the first; other shapes trace again."""
  mesh = mesh_of((2, 4), DATA_EXPERT)

  @jax.jit
  @chex.assert_max_traces(n=1)
  def grads(x_TD, idx_TK, *diff):
    def loss(x, w, *weights):
      return jnp.sum(rm.moe_ffn(x, idx_TK, w, *weights, mesh=mesh, dispatcher="ring_expert") ** 2)

    return jax.grad(loss, argnums=range(5))(x_TD, *diff)

  def args(layer):
    return [layer[a] for a in ("x_TD", "idx_TK", *DIFF_ARGS[1:])]
  uniform, skewed = (args(random_layer(5, TOKENS, D_MODEL, D_FF, 16, 2, skew=skew)) for skew in (False, True))
  g_uniform, g_skewed = grads(*uniform), grads(*skewed)
  chex.assert_tree_all_finite((g_uniform, g_skewed))
  assert float(jnp.max(jnp.abs(g_uniform[1] - g_skewed[1]))) > 1e-3, "different routing, different gradients"
  with pytest.raises(AssertionError, match="traced > 1 times"):
    grads(*args(random_layer(5, TOKENS // 2, D_MODEL, D_FF, 16, 2)))


FULL_TABLE = [((n,), E_ONLY, e, k, skew, None) for n in (1, 2, 4, 8) for e in (8, 16, 64) for k in (1, 2, 8)
              for skew in (False, True) if e % n == 0]
# CI's slow step: three cases per dispatcher beside the default run's, ring sizes 1-8, E 8-64, K 1-8, both routings;
# the rest of the table (207 cases) is `pytest -m full_grid`.
SLOW_TABLE = {"ring_expert": [(2, 16, 1, False), (4, 64, 8, True), (8, 8, 8, True)],
              "ring_token": [(2, 64, 2, True), (4, 8, 8, False), (8, 16, 1, True)],
              "all_to_all": [(1, 64, 8, True), (4, 16, 2, True), (8, 64, 2, False)]}


def _table_mark(case, dispatcher):
  (n,), _, e, k, skew, _ = case
  return pytest.mark.slow if (n, e, k, skew) in SLOW_TABLE[dispatcher] else pytest.mark.full_grid


@pytest.mark.parametrize("case, dispatcher", [
    pytest.param(case, d, marks=_table_mark(case, d), id=f"{_case_id(case)}-{d}")
    for case in FULL_TABLE for d in ("ring_expert", "ring_token", "all_to_all")])
def test_full_table_float32_matches_oracle(case, dispatcher):
  """Every ring size × top-k × expert count × skew of the spec (the default run covers a representative subset;
  CI's slow step `SLOW_TABLE`; `pytest -m full_grid` all of it)."""
  test_float32_matches_oracle(case, dispatcher)


@pytest.mark.parametrize("dispatcher, options", [("ring_expert", {}), ("ring_token", {}), ("all_to_all", {}),
                                                 ("ring_expert", {"reverse_backward": True})])
@pytest.mark.parametrize("skew", [False, True])
def test_expert_tensor_parallel_matches_oracle(dispatcher, options, skew):
  """(2 data × 2 expert × 2 tensor): tokens over data and expert, F of every expert split over tensor."""
  layer = random_layer(13, TOKENS, D_MODEL, D_FF, 8, 2, skew=skew)
  assert_matches_oracle(layer, mesh_of((2, 2, 2), ETP_NAMES), F32_RTOL, dispatcher, tensor_axis=rm.TENSOR,
                        **options)


@pytest.mark.parametrize("dispatcher", ["ring_expert", "ring_token"])
def test_shared_expert_matches_oracle(dispatcher):
  """The Qwen2-MoE shared expert (sigmoid-gated SwiGLU of width S), values and gradients of every weight."""
  layer = random_layer(17, TOKENS, D_MODEL, D_FF, 8, 2)
  rng = np.random.default_rng(17)
  s = 20
  shared = tuple(jnp.asarray(rng.normal(size=shape) / np.sqrt(shape[0]), jnp.float32)
                 for shape in ((D_MODEL, s), (D_MODEL, s), (s, D_MODEL), (D_MODEL, 1)))
  mesh = mesh_of((2, 4), DATA_EXPERT)
  c_TD = jnp.asarray(rng.normal(size=(TOKENS, D_MODEL)), jnp.float32)

  def loss(dispatcher, x, w, shared):
    y = rm.moe_ffn(x, layer["idx_TK"], w, layer["w_gate_EDF"], layer["w_up_EDF"], layer["w_down_EFD"], mesh=mesh,
                   dispatcher=dispatcher, shared=shared[:3], shared_gate_D1=shared[3])
    return jnp.sum(y * c_TD)

  def reference(x, w, shared):
    h = jax.nn.silu(x @ shared[0]) * (x @ shared[1])
    y = rm.dense_moe(x, layer["idx_TK"], w, layer["w_gate_EDF"], layer["w_up_EDF"], layer["w_down_EFD"])
    return jnp.sum((y + jax.nn.sigmoid(x @ shared[3]) * (h @ shared[2])) * c_TD)

  with jax.default_matmul_precision("highest"):
    ref_v, ref_g = jax.jit(jax.value_and_grad(reference, argnums=(0, 1, 2)))(layer["x_TD"], layer["w_TK"], shared)
  v, g = jax.jit(jax.value_and_grad(lambda *a: loss(dispatcher, *a), argnums=(0, 1, 2)))(
      layer["x_TD"], layer["w_TK"], shared)
  assert abs(float(v) - float(ref_v)) <= F32_RTOL * abs(float(ref_v))
  for name, a, b in zip(("x", "w_TK"), g[:2], ref_g[:2]):
    assert_close(a, b, F32_RTOL, name)
  for i, (a, b) in enumerate(zip(g[2], ref_g[2])):
    assert_close(a, b, F32_RTOL, f"shared[{i}]")
