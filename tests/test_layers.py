"""The Flax layers `rm.linen.MoE` and `rm.nnx.MoE` against the dense float32 oracle (values and gradients w.r.t. x,
the router and every expert weight), [B, S, D] in and out, with a shared expert, under scan and remat, on
Explicit and Auto meshes with renamed axes."""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import relaymoe_jax as rm
import relaymoe_jax.testing as rmt
from conftest import mesh_of

F32_RTOL = 1e-5
SIZES = dict(num_experts=8, top_k=2, d_ff=12)
ROWS, EXPERTS = "rows", "experts"  # renamed mesh axes


def _x(shape=(4, 6, 8), seed=0):
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


def _mesh(explicit):
  return mesh_of((2, 4), (ROWS, EXPERTS), explicit=explicit)


@pytest.mark.slow  # 9 s on 2 cores; the NNX layer on an Explicit mesh stays in the default run
@pytest.mark.parametrize("explicit", [False, True], ids=["auto", "explicit"])
def test_linen_layer_matches_oracle_with_shared_expert(explicit):
  mesh = _mesh(explicit)
  layer = rm.linen.MoE(**SIZES, shared_d_ff=6, mesh=mesh, expert_axis=EXPERTS, dispatcher="ring_expert")
  x = _x((3, 5, 8))  # 15 tokens: not a multiple of the 8 token shards, padded inside
  with jax.set_mesh(mesh):  # a jit whose outputs are on an Explicit mesh needs it (JAX's rule)
    variables = jax.jit(layer.init)(jax.random.key(0), x)
  assert nn.get_partition_spec(variables)["params"]["w_gate_EDF"] == jax.sharding.PartitionSpec(EXPERTS, None, None)
  errors = rmt.assert_layer_matches_dense_oracle(layer, x, variables=variables, rtol=F32_RTOL)
  assert set(errors["params"]) == {"router_DE", "w_gate_EDF", "w_up_EDF", "w_down_EFD", "shared_gate_DF",
                                   "shared_up_DF", "shared_down_FD", "shared_gate_D1"}
  (y, aux), state = jax.jit(functools.partial(layer.apply, mutable=["intermediates"]))(variables, x)
  assert y.shape == x.shape and isinstance(aux, rm.MoEAux)
  assert state["intermediates"][rm.linen.AUX_NAME][0].router.expert_counts_E.sum() == 15 * 2


@pytest.mark.slow  # ~7 s each; the default run reached 9.6 min on 2 cores, over 10 on CI's; CI's second step runs it
@pytest.mark.parametrize("explicit", [False, True], ids=["auto", "explicit"])
def test_nnx_layer_matches_oracle(explicit):
  mesh = _mesh(explicit)
  layer = rm.nnx.MoE(8, **SIZES, mesh=mesh, expert_axis=EXPERTS, dispatcher="ring_token", rngs=nnx.Rngs(0))
  assert tuple(layer.w_down_EFD.out_sharding) == (EXPERTS, None, None)
  assert layer.w_down_EFD[...].sharding.spec == jax.sharding.PartitionSpec(EXPERTS, None, None)
  rmt.assert_layer_matches_dense_oracle(layer, _x(), rtol=F32_RTOL)


@pytest.mark.slow  # 8-10 s on 2 cores; CI's second step runs it
def test_linen_layers_under_scan_and_remat_match_the_oracle():
  """Two stacked layers, one `nn.scan` over a remat'd layer, parameters with a replicated layer axis."""
  mesh = _mesh(False)

  class Stack(nn.Module):
    dispatcher: str = "ring_expert"

    @nn.compact
    def __call__(self, x):
      def body(block, x):
        y, aux = block(x)
        return x + y, aux.router.load_balancing_loss
      scan = nn.scan(nn.remat(body), variable_axes={"params": 0}, split_rngs={"params": True}, length=2,
                     metadata_params={nn.PARTITION_NAME: None})
      x, lb = scan(rm.linen.MoE(**SIZES, mesh=mesh, expert_axis=EXPERTS, dispatcher=self.dispatcher), x)
      return x, lb

  x = _x()
  variables = Stack().init(jax.random.key(1), x)
  assert nn.get_partition_spec(variables)["params"]["MoE_0"]["w_up_EDF"] == jax.sharding.PartitionSpec(
      None, EXPERTS, None, None)

  def grads(dispatcher):
    loss = lambda v, x: jnp.sum(jnp.sin(Stack(dispatcher).apply(v, x)[0]))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(variables, x)

  rmt.assert_trees_close(grads("ring_expert"), grads("dense"), F32_RTOL)


@pytest.mark.slow  # 8-10 s on 2 cores; CI's second step runs it
def test_nnx_layers_under_scan_and_remat_match_the_oracle():
  mesh = _mesh(True)

  @nnx.split_rngs(splits=2)
  @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
  def stack(rngs):
    return rm.nnx.MoE(8, **SIZES, mesh=mesh, expert_axis=EXPERTS, rngs=rngs)

  layers = stack(nnx.Rngs(2))
  assert tuple(layers.w_gate_EDF.out_sharding) == (None, EXPERTS, None, None)

  def forward(layers, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
    @nnx.remat
    def body(x, layer):
      y, aux = layer(x)
      return x + y, aux.router.z_loss
    x, z = body(x, layers)
    return jnp.sum(jnp.sin(x)) + jnp.sum(z)

  def grads(dispatcher):
    graphdef, params = nnx.split(layers)
    config = dataclasses.replace(layers.config, dispatcher=dispatcher)

    def loss(params, x):
      model = nnx.merge(graphdef, params)
      model.config = config
      return forward(model, x)
    with jax.set_mesh(mesh):
      return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, _x())

  rmt.assert_trees_close(grads("ring_expert"), grads("dense"), F32_RTOL)


def test_bfloat16_compute_matches_the_float32_oracle():
  layer = rm.nnx.MoE(8, **SIZES, shared_d_ff=6, dtype=jnp.bfloat16, mesh=_mesh(False), expert_axis=EXPERTS,
                     dispatcher="auto", rngs=nnx.Rngs(4))
  rmt.assert_layer_matches_dense_oracle(layer, _x(), rtol=3e-2)


def test_dispatcher_options_reach_the_block_and_drops_reach_aux():
  """`dispatcher_options` go to the dispatcher: a capacity factor of 0.5 drops pairs, and aux counts them."""
  layer = rm.linen.MoE(**SIZES, mesh=_mesh(False), expert_axis=EXPERTS, dispatcher="all_to_all",
                       dispatcher_options=dict(capacity_factor=0.5))
  x = _x((8, 8, 8))
  y, aux = jax.jit(layer.apply)(jax.jit(layer.init)(jax.random.key(3), x), x)
  assert y.shape == x.shape and int(aux.dropped_pairs) > 0


@pytest.mark.parametrize("changes,message", [
    (dict(num_experts=6), "E=6 experts is not divisible by the size 4 of expert axis 'experts'"),
    (dict(expert_axis="expert"), "expert_axis 'expert' is not an axis of the mesh"),
    (dict(chunk_rows=4), r"unknown argument\(s\) \['chunk_rows'\] for rm.nnx.MoE.*dispatcher_options"),
    (dict(top_k=9), "top_k=9 must be between 1 and the number of experts E=8"),
    (dict(dispatcher_options=dict(chunk_row=4)), r"unknown option\(s\) \['chunk_row'\]"),
])
def test_nnx_construction_errors_are_the_projects(changes, message):
  """Named before any parameter is placed, as Linen and `moe_ffn` name them (not JAX's placement errors)."""
  with pytest.raises(ValueError, match=message):
    rm.nnx.MoE(8, **{**SIZES, "mesh": _mesh(False), "expert_axis": EXPERTS, **changes}, rngs=nnx.Rngs(0))


def test_linen_jit_init_on_an_explicit_mesh_without_a_mesh_context():
  """`jax.jit(layer.init)` with no `jax.set_mesh`, as a plain `nn.Dense` allows: experts split over the expert
  axis, and the layer then runs under `jax.jit(layer.apply)` with y sharded as x came."""
  mesh = _mesh(True)
  layer = rm.linen.MoE(**SIZES, mesh=mesh, expert_axis=EXPERTS)
  x = jax.device_put(_x((8, 4, 8)), NamedSharding(mesh, P(ROWS)))
  variables = jax.jit(layer.init)(jax.random.key(0), x)
  assert tuple(variables["params"]["w_gate_EDF"].value.sharding.spec)[0] == EXPERTS
  y, _ = jax.jit(layer.apply)(variables, x)
  assert y.sharding.is_equivalent_to(x.sharding, x.ndim)


@pytest.mark.parametrize("spec", [P(), P(ROWS), P(None, EXPERTS)], ids=["replicated", "rows", "sequence"])
def test_on_an_auto_mesh_y_comes_back_sharded_as_x_came(spec):
  """As on Explicit meshes (where the type says so), not over both token axes whatever x's sharding."""
  mesh = _mesh(False)
  layer = rm.nnx.MoE(8, **SIZES, mesh=mesh, expert_axis=EXPERTS, rngs=nnx.Rngs(0))
  x = jax.device_put(_x((8, 4, 8)), NamedSharding(mesh, spec))
  y, _ = nnx.jit(lambda m, x: m(x))(layer, x)
  assert y.sharding.is_equivalent_to(x.sharding, x.ndim), (y.sharding, x.sharding)


@pytest.mark.parametrize("explicit", [pytest.param(False, marks=pytest.mark.slow), True], ids=["auto", "explicit"])
def test_logical_axis_rules_without_the_expert_axis_are_named(explicit):
  """A Linen model that maps specs through `nn.logical_to_mesh_sharding(specs, mesh, rules)` (lm1b, MaxText) keeps
  the experts split only with `rm.linen.axis_rules(...)` in its rules; without them the layer raises naming the
  rule to add (Explicit axes: in the jitted call, from the type; Auto axes: where the arrays are concrete)."""
  mesh = _mesh(explicit)
  layer = rm.linen.MoE(**SIZES, mesh=mesh, expert_axis=EXPERTS)
  x = _x((8, 4, 8))
  user_rules = (("batch", ROWS), ("embed", None))
  specs = nn.get_partition_spec(jax.eval_shape(layer.init, jax.random.key(0), x))

  def init(rules):
    shardings = nn.logical_to_mesh_sharding(specs, mesh, rules)
    return jax.jit(layer.init, out_shardings=shardings)(jax.random.key(0), x)

  good = init(user_rules + rm.linen.axis_rules(EXPERTS))
  assert tuple(good["params"]["w_gate_EDF"].value.sharding.spec)[0] == EXPERTS
  replicated = init(user_rules)
  apply = jax.jit(layer.apply) if explicit else layer.apply
  with pytest.raises(ValueError, match=r"w_gate_EDF \(8, 8, 12\) is not split over expert axis 'experts'.*add "
                                       r"\(\('experts', 'experts'\),\) to the rules"):
    apply(replicated, x)


def test_nnx_layer_with_experts_placed_whole_is_named():
  """The same check in NNX: expert weights placed replicated (by rules without the expert axis) are refused."""
  mesh = _mesh(False)
  layer = rm.nnx.MoE(8, **SIZES, mesh=mesh, expert_axis=EXPERTS, rngs=nnx.Rngs(0))
  layer.w_gate_EDF.set_value(jax.device_put(layer.w_gate_EDF[...], NamedSharding(mesh, P())))
  with pytest.raises(ValueError, match="w_gate_EDF .* is not split over expert axis 'experts'"):
    layer(_x())
