"""The public call pattern on the meshes users build: Explicit (`jax.make_mesh`) and Auto, eager and under the
caller's jit, inputs arriving with other shardings, dispatcher instances, and route → moe_ffn end to end."""

import time

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import relaymoe_jax as rm
import relaymoe_jax.testing as rmt
from conftest import assert_close, mesh_of, random_layer
from relaymoe_jax.ring.chunks import chunk_ladder, default_chunk_rows
from test_equivalence import DATA_EXPERT, F32_RTOL

ARGS = ("x_TD", "idx_TK", "w_TK", "w_gate_EDF", "w_up_EDF", "w_down_EFD")


def test_explicit_mesh_under_set_mesh():
  mesh = mesh_of((2, 4), DATA_EXPERT, explicit=True)
  layer = random_layer(0, 64, 16, 24, 16, 4)
  with jax.set_mesh(mesh):
    layer = {k: jax.device_put(v, NamedSharding(mesh, P(rm.EXPERT) if k in ARGS[3:] else P()))
             for k, v in layer.items()}
    y, _ = rmt.values_and_grads(layer, mesh=mesh, dispatcher="ring_expert")
    rmt.assert_matches_dense_oracle(mesh=mesh, dispatcher="ring_expert", rtol=F32_RTOL, **layer)
  assert not any(y.sharding.spec), y.sharding  # as x came, replicated (the ring itself ran split over the token axes)


def test_explicit_mesh_output_sharded_as_x_for_a_residual_add():
  """On an Explicit mesh y comes back with x's own sharding (here over 'data' only, not every token axis), so the
  residual `x + moe_ffn(x, ...)` type-checks under jit."""
  mesh = mesh_of((2, 4), DATA_EXPERT, explicit=True)
  layer = random_layer(4, 64, 16, 24, 16, 4)
  with jax.set_mesh(mesh):
    x_TD = jax.device_put(layer["x_TD"], NamedSharding(mesh, P(rm.DATA)))
    residual = jax.jit(lambda x, *rest: x + rm.moe_ffn(x, *rest, mesh=mesh, dispatcher="ring_expert"))
    out = residual(x_TD, *(layer[a] for a in ARGS[1:]))
    rmt.assert_matches_dense_oracle(mesh=mesh, dispatcher="ring_expert", rtol=F32_RTOL, **dict(layer, x_TD=x_TD))
  assert tuple(out.sharding.spec) == (rm.DATA, None)
  assert_close(out, layer["x_TD"] + rm.dense_moe(*(layer[a] for a in ARGS)), F32_RTOL, "x + y")


def test_out_sharding_is_the_outputs_on_auto_and_explicit_meshes():
  """Given, y comes back as it says (inside the caller's jit on an Auto mesh too, where x's sharding is no type);
  anything but a PartitionSpec or NamedSharding is named."""
  layer = random_layer(2, 64, 16, 24, 8, 2)
  for explicit in (False, True):
    mesh = mesh_of((2, 4), DATA_EXPERT, explicit=explicit)
    x_TD = jax.device_put(layer["x_TD"], NamedSharding(mesh, P(rm.DATA)))
    call = jax.jit(lambda x, *rest: rm.moe_ffn(x, *rest, mesh=mesh, out_sharding=P(None, rm.EXPERT)))
    y = call(x_TD, *(layer[a] for a in ARGS[1:]))
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, P(None, rm.EXPERT)), 2), (explicit, y.sharding)
    assert_close(y, rm.dense_moe(*(layer[a] for a in ARGS)), F32_RTOL, "y")
  with pytest.raises(ValueError, match=r"out_sharding=\('data',\) must be a PartitionSpec or a NamedSharding"):
    rm.moe_ffn(*(layer[a] for a in ARGS), mesh=mesh, out_sharding=(rm.DATA,))


@pytest.mark.slow  # 7 s on 2 cores (the default run reached 10.5 min on CI); CI's second step runs it
def test_auto_mesh_eager_call_and_resharded_inputs():
  """Called outside jit with inputs sharded some other way (x split over D, the routing replicated): resharded, not
  rejected, and the output comes back sharded as x came (split over D), ready for the caller's residual add."""
  mesh = mesh_of((8,), (rm.EXPERT,))
  layer = random_layer(1, 64, 16, 24, 8, 2)
  odd = {k: jax.device_put(v, NamedSharding(mesh, P(rm.EXPERT) if k in ARGS[3:] else
                                            P(None, rm.EXPERT) if v.shape[1] % 8 == 0 else P()))
         for k, v in layer.items()}
  y = rm.moe_ffn(*(odd[a] for a in ARGS), mesh=mesh, dispatcher="ring_expert")
  assert y.sharding.is_equivalent_to(odd["x_TD"].sharding, y.ndim), y.sharding
  assert_close(y, rm.dense_moe(*(layer[a] for a in ARGS)), F32_RTOL, "y")


@pytest.mark.slow  # 8-10 s on 2 cores; CI's second step runs it
def test_dispatcher_instance_and_options_are_equivalent():
  mesh = mesh_of((4,), (rm.EXPERT,))
  layer = random_layer(2, 32, 16, 24, 8, 2, skew=True)
  by_name = rm.moe_ffn(*(layer[a] for a in ARGS), mesh=mesh, dispatcher="ring_expert", chunk_rows=4)
  by_instance = rm.moe_ffn(*(layer[a] for a in ARGS), mesh=mesh, dispatcher=rm.RingExpert(chunk_rows=4))
  chex.assert_trees_all_equal(by_name, by_instance)


def test_route_then_moe_inside_callers_jit_gradients_reach_router():
  """The block as a model uses it: route, then the ring, inside one jit; d(router) and dx match the dense path."""
  mesh = mesh_of((2, 4), DATA_EXPERT)
  rng = np.random.default_rng(3)
  layer = random_layer(3, 64, 16, 24, 16, 4)
  router_DE = jnp.asarray(rng.normal(size=(16, 16)), jnp.float32)

  def block_loss(dispatcher):
    @jax.jit
    def f(x_TD, router_DE, w_gate, w_up, w_down):
      idx_TK, w_TK, aux = rm.route(x_TD, router_DE, top_k=4)
      y_TD = rm.moe_ffn(x_TD, idx_TK, w_TK, w_gate, w_up, w_down, mesh=mesh, dispatcher=dispatcher)
      return jnp.sum(jnp.sin(y_TD)) + 0.01 * aux.load_balancing_loss
    return jax.value_and_grad(f, argnums=range(5))(layer["x_TD"], router_DE, layer["w_gate_EDF"],
                                                   layer["w_up_EDF"], layer["w_down_EFD"])

  (v_ref, g_ref), (v, g) = block_loss("dense"), block_loss("ring_expert")
  assert abs(float(v) - float(v_ref)) <= F32_RTOL * abs(float(v_ref))
  for name, a, b in zip(("x", "router", "w_gate", "w_up", "w_down"), g, g_ref):
    assert_close(a, b, F32_RTOL, name)


def test_default_chunk_ladder():
  # Qwen3-30B at EP 2: share 262144 rows; the first size is 31/32 of it, then 1/4 and 1/16 of that for the tail.
  assert default_chunk_rows(65536, 8, 2) == (253952, 63488, 15872)
  assert default_chunk_rows(64, 2, 8) == (128,)  # small shares: one size, the share rounded up to 128
  assert default_chunk_rows(65536, 8, 2, row_cap=8192) == (7936, 2048)  # tail sizes round up to 128
  # A ring of one holds every pair in its one hop: one chunk of the whole share, unless capped below it.
  assert default_chunk_rows(65536, 8, 1) == (524288,) and default_chunk_rows(100, 3, 1) == (384,)
  assert default_chunk_rows(65536, 8, 1, row_cap=131072) == (126976, 31744, 7936)
  assert chunk_ladder(4095) == (4095,) and chunk_ladder(4096) == (4096, 1024)


ODD_CASES = [pytest.param(d, False, id=f"{d}-auto") for d in sorted(rm.DISPATCHERS)] + [
    pytest.param(d, True, id=f"{d}-explicit", marks=() if d in ("ring_expert", "dense") else pytest.mark.slow)
    for d in sorted(rm.DISPATCHERS)]


@pytest.mark.parametrize("dispatcher, explicit", ODD_CASES)
def test_odd_token_counts_are_padded_inside(dispatcher, explicit):
  """T = 60 on 8 token shards: padding rows route nowhere; values and every gradient match the oracle (itself
  padded, so for "dense" y is also checked against the unpadded dense math)."""
  mesh = mesh_of((2, 4), DATA_EXPERT, explicit=explicit)
  layer = random_layer(5, 60, 16, 24, 16, 4)
  rmt.assert_matches_dense_oracle(mesh=mesh, dispatcher=dispatcher, rtol=F32_RTOL, **layer)
  if dispatcher == "dense":
    y = rm.moe_ffn(*(layer[a] for a in ARGS), mesh=mesh, dispatcher=dispatcher)
    assert_close(y, rm.dense_moe(*(layer[a] for a in ARGS)), F32_RTOL, "y")


@pytest.mark.slow  # 10 s on 2 cores (the default run reached 10.5 min on CI); CI's second step runs it
@pytest.mark.parametrize("explicit", [False, True], ids=["auto", "explicit"])
def test_batch_seq_input_and_mesh_from_the_context(explicit):
  """x [B, S, D] with routing [B, S, K], no mesh= (the `jax.set_mesh` context's, eager and under jit), renamed
  axes, a shared expert: y [B, S, D] as the [T, D] call gives it, sharded as x came on an Explicit mesh."""
  mesh = mesh_of((2, 4), ("rows", "experts"), explicit=explicit)
  layer = random_layer(6, 24, 16, 24, 16, 4)
  rng = np.random.default_rng(6)
  shared = tuple(jnp.asarray(rng.normal(size=s) / 4, jnp.float32) for s in ((16, 8), (16, 8), (8, 16)))
  gate_D1 = jnp.asarray(rng.normal(size=(16, 1)), jnp.float32)
  bsd = {k: v.reshape(4, 6, -1) if k in ARGS[:3] else v for k, v in layer.items()}
  kw = dict(expert_axis="experts", shared=shared, shared_gate_D1=gate_D1)
  expected = rm.moe_ffn(*(layer[a] for a in ARGS), mesh=mesh, dispatcher="dense", **kw)
  with jax.set_mesh(mesh):
    x_BSD = jax.device_put(bsd["x_TD"], NamedSharding(mesh, P("rows")))
    eager = rm.moe_ffn(x_BSD, *(bsd[a] for a in ARGS[1:]), **kw)
    jitted = jax.jit(lambda x, *rest: rm.moe_ffn(x, *rest, **kw))(x_BSD, *(bsd[a] for a in ARGS[1:]))
  for y in (eager, jitted):
    assert y.shape == (4, 6, 16)
    assert_close(y.reshape(24, 16), expected, F32_RTOL, "y")
  if explicit:
    assert tuple(eager.sharding.spec)[:1] == ("rows",), eager.sharding


def test_no_mesh_anywhere_is_named():
  layer = random_layer(0, 16, 8, 12, 8, 2)
  with pytest.raises(ValueError, match="no mesh: pass mesh="):
    rm.moe_ffn(*(layer[a] for a in ARGS))


def test_dense_under_callers_jit_on_an_explicit_mesh_without_set_mesh():
  mesh = mesh_of((2, 4), DATA_EXPERT, explicit=True)
  layer = random_layer(7, 64, 16, 24, 16, 4)
  loss = jax.jit(jax.grad(lambda x, *rest: jnp.sum(rm.moe_ffn(x, *rest, mesh=mesh, dispatcher="dense") ** 2)))
  dx = loss(*(layer[a] for a in ARGS))
  expected = jax.grad(lambda x: jnp.sum(rm.dense_moe(x, *(layer[a] for a in ARGS[1:])) ** 2))(layer["x_TD"])
  assert_close(dx, expected, F32_RTOL, "dx")


def test_capacity_drops_are_counted():
  """Skewed routing overflows a capacity factor of 1: `return_stats` counts the dropped pairs; dropless
  dispatchers report 0."""
  mesh = mesh_of((4,), (rm.EXPERT,))
  layer = random_layer(8, 32, 16, 24, 8, 2, skew=True)

  def stats(dispatcher, **options):
    call = lambda *a: rm.moe_ffn(*a, mesh=mesh, dispatcher=dispatcher, return_stats=True, **options)[1]
    return int(jax.jit(call)(*(layer[a] for a in ARGS)).dropped_pairs)

  # Per device: 8 tokens · 2 pairs, all to partition 0, whose slots hold ceil(1.0 · 16 / 4) = 4 rows.
  assert stats("all_to_all", capacity_factor=1.0) == 4 * (16 - 4)
  assert stats("all_to_all") == 0 and stats("dense") == 0


@pytest.mark.slow  # 6 s on 2 cores (the default run reached 10.5 min on CI); CI's second step runs it
def test_vmap_over_tokens_is_refused_with_the_way_out():
  mesh = mesh_of((4,), (rm.EXPERT,))
  layer = random_layer(9, 32, 16, 24, 8, 2)
  batched = {k: v.reshape(2, 16, -1) if k in ARGS[:3] else v for k, v in layer.items()}
  block = lambda x, i, w: rm.moe_ffn(x, i, w, *(layer[a] for a in ARGS[3:]), mesh=mesh)
  with pytest.raises(ValueError, match=r"cannot run under jax.vmap.*take x \[\.\.\., D\]"):
    jax.vmap(block)(*(batched[a] for a in ARGS[:3]))
  with pytest.raises(ValueError, match="cannot run under jax.vmap"):
    jax.grad(lambda x: jnp.sum(jax.vmap(block)(x, *(batched[a] for a in ARGS[1:3]))))(batched["x_TD"])
  # The way out: the batch as leading dims.
  y = block(*(batched[a] for a in ARGS[:3]))
  assert_close(y.reshape(32, 16), rm.dense_moe(*(layer[a] for a in ARGS)), F32_RTOL, "y")


def test_route_takes_any_leading_dims():
  x_TD = jnp.asarray(np.random.default_rng(10).normal(size=(24, 16)), jnp.float32)
  router_DE = jnp.asarray(np.random.default_rng(11).normal(size=(16, 8)), jnp.float32)
  flat = rm.route(x_TD, router_DE, top_k=2)
  idx_BSK, w_BSK, aux = rm.route(x_TD.reshape(4, 6, 16), router_DE, top_k=2)
  assert idx_BSK.shape == (4, 6, 2) and w_BSK.shape == (4, 6, 2)
  chex.assert_trees_all_close((idx_BSK.reshape(24, 2), w_BSK.reshape(24, 2), aux), flat, rtol=1e-6)


def test_programs_with_collectives_in_flight_together_finish_on_emulated_devices():
  """160 programs with collectives, on all 8 devices and on 4 of them, dispatched before any finishes (as a
  checkpoint's checksums or the oracle check's pieces are). XLA:CPU runs them on one thread pool, which conftest
  sizes through NPROC; at its default of max(cores, devices) they deadlocked on 2 cores and XLA aborted the process."""
  meshes = [mesh_of((8,), ("x",)), mesh_of((4,), ("x",))]
  arrays = [jax.device_put(jnp.full((8, 64), float(i)), NamedSharding(m, P("x"))) for i, m in
            enumerate(meshes * 8)]
  programs = [jax.jit(lambda a, k=k: (a * k).sum(0) + a.sum()) for k in range(16)]
  sums = jax.block_until_ready([[f(a) for f, a in zip(programs, arrays)] for _ in range(10)])[-1]
  assert [float(s[0]) for s in sums] == [8.0 * k * k + 512.0 * k for k in range(16)]  # rows·k·i + 8·64·i, i = k


@pytest.mark.slow  # ~6 s; the default run reached 9.6 min on 2 cores, over 10 on CI's; CI's second step runs it
def test_eager_calls_compile_once():
  """Outside a trace, `moe_ffn` (and so each layer) compiles once per static arguments and shapes: a second eager
  call of an NNX layer takes at least 20x less than the first (the first: ~1-2 s; it took as long every call, 3-6
  s on 2 cores), and gives the same output."""
  layer = rm.nnx.MoE(8, num_experts=8, top_k=2, d_ff=12, mesh=mesh_of((2, 4), DATA_EXPERT), rngs=nnx.Rngs(0))
  x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 6, 8)), jnp.float32)

  def timed_call():
    start = time.perf_counter()
    y, _ = layer(x)
    return jax.block_until_ready(y), time.perf_counter() - start

  first, first_s = timed_call()
  again = [timed_call() for _ in range(3)]
  np.testing.assert_array_equal(np.asarray(again[0][0]), np.asarray(first))
  assert first_s >= 20 * min(s for _, s in again), (first_s, [s for _, s in again])
