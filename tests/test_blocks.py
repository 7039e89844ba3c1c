"""A whole MoE block of the user's own (router and experts, no Flax) against the dense float32 oracle through
`relaymoe_jax.testing`, values and every gradient (1e-5), under every dispatcher: an Equinox module, a plain-JAX
function over a dict of weights (with a shared expert), and that function inside the user's own `shard_map` (over
every axis, the arrays per device; and over the data axis only; on Auto and Explicit axes); the refusals of what
cannot run. The mutants these
tests kill are in tests/README.md ("block in a user's shard_map", "replicated expert weights", "whole-block check").
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import relaymoe_jax as rm
import relaymoe_jax.testing as rmt
from conftest import mesh_of

# The `test` extra installs it; where it is missing (a GPU image installed with --no-deps) this file is skipped, not
# an error that stops `pytest -m gpu` from collecting.
eqx = pytest.importorskip("equinox", reason="needs equinox (pip install -e '.[test]')")

RTOL = 1e-5
D, F, E, K = 8, 12, 8, 2
DATA_EXPERT = (rm.DATA, rm.EXPERT)
DISPATCHERS = sorted(rm.DISPATCHERS)


def _weights(seed):
  rng = np.random.default_rng(seed)
  shapes = dict(router_DE=(D, E), w_gate_EDF=(E, D, F), w_up_EDF=(E, D, F), w_down_EFD=(E, F, D),
                shared_gate_DF=(D, F), shared_up_DF=(D, F), shared_down_FD=(F, D), shared_gate_D1=(D, 1))
  return {n: jnp.asarray(rng.normal(size=s) / np.sqrt(s[-2]), jnp.float32) for n, s in shapes.items()}


def _tokens(seed, shape=(4, 8, D)):
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


class EquinoxMoE(eqx.Module):
  """How an Equinox user writes the block: weights as fields, `rm.route` + `rm.moe_ffn` in `__call__`."""

  router_DE: jax.Array
  w_gate_EDF: jax.Array
  w_up_EDF: jax.Array
  w_down_EFD: jax.Array
  mesh: jax.sharding.Mesh = eqx.field(static=True)
  dispatcher: str = eqx.field(static=True)

  def __call__(self, x_BSD):
    idx, w, aux = rm.route(x_BSD, self.router_DE, top_k=K)
    y = rm.moe_ffn(x_BSD, idx, w, self.w_gate_EDF, self.w_up_EDF, self.w_down_EFD, mesh=self.mesh,
                   dispatcher=self.dispatcher)
    return y, aux


def plain_block(weights, x_TD, *, dispatcher, mesh=None):
  """A plain-JAX block over a dict of weights, with a gated shared expert (Qwen2-MoE)."""
  idx_TK, w_TK, _ = rm.route(x_TD, weights["router_DE"], top_k=K)
  shared = tuple(weights[n] for n in ("shared_gate_DF", "shared_up_DF", "shared_down_FD"))
  return rm.moe_ffn(x_TD, idx_TK, w_TK, weights["w_gate_EDF"], weights["w_up_EDF"], weights["w_down_EFD"],
                    shared=shared, shared_gate_D1=weights["shared_gate_D1"], mesh=mesh, dispatcher=dispatcher)


def _equinox_block(dispatcher):
  experts = {n: w for n, w in _weights(0).items() if not n.startswith("shared")}
  return EquinoxMoE(**experts, mesh=mesh_of((2, 4), DATA_EXPERT), dispatcher=dispatcher)


def _plain_block(dispatcher):
  per_device = functools.partial(plain_block, dispatcher=dispatcher, mesh=mesh_of((2, 4), DATA_EXPERT))
  return jax.tree_util.Partial(per_device, _weights(2))


def _in_shard_map(manual, dispatcher, explicit=False):
  """The plain block inside the user's shard_map: over every axis (tokens over both, each device its E/4
  experts) or over the data axis only (the experts whole, the block splitting them itself). On Explicit axes the
  caller places x and the weights first, as `jax.shard_map` wants (the experts over 'expert' in either form)."""
  mesh = mesh_of((2, 4), DATA_EXPERT, explicit=explicit)
  tokens = P(DATA_EXPERT) if manual == "every axis" else P(rm.DATA)
  experts = P(rm.EXPERT) if manual == "every axis" else P()
  specs = {n: experts if n.endswith(("EDF", "EFD")) else P() for n in _weights(2)}
  names = {rm.DATA, rm.EXPERT} if manual == "every axis" else {rm.DATA}
  per_device = jax.shard_map(functools.partial(plain_block, dispatcher=dispatcher), mesh=mesh,
                             in_specs=(specs, tokens), out_specs=tokens, axis_names=names)
  if not explicit:
    return jax.tree_util.Partial(per_device, _weights(2))
  placed = {n: P(rm.EXPERT) if n.endswith(("EDF", "EFD")) else P() for n in _weights(2)}

  def placed_first(weights, x):
    on_mesh = lambda a, spec: jax.sharding.reshard(a, NamedSharding(mesh, spec))
    return per_device(jax.tree.map(on_mesh, weights, placed), on_mesh(x, P(DATA_EXPERT)))

  return jax.tree_util.Partial(placed_first, _weights(2))


BLOCKS = {"equinox": (_equinox_block, (4, 8, D)), "plain": (_plain_block, (32, D)),
          "shard_map over every axis": (functools.partial(_in_shard_map, "every axis"), (32, D)),
          "shard_map over data": (functools.partial(_in_shard_map, "data axis"), (32, D)),
          "shard_map over every axis, Explicit": (functools.partial(_in_shard_map, "every axis", explicit=True), (32, D)),
          "shard_map over data, Explicit": (functools.partial(_in_shard_map, "data axis", explicit=True), (32, D))}


@functools.cache
def _oracle(kind):
  """The kind's oracle, once for every dispatcher: its block with each moe_ffn run by "dense", in float32."""
  make, shape = BLOCKS[kind]
  y, grads = rmt.block_values_and_grads(make("ring_expert"), _tokens(1, shape), dispatcher="dense", float32=True)
  return dict(y=y, **grads)


def _slow(kind, dispatcher):
  """The plain block outside a shard_map is test_equivalence's ground, and "auto" runs one of the rings, each here:
  their cases run in CI's slow step (the default run stays under 10 minutes on 2 cores)."""
  return (kind in ("plain", *EXPLICIT) and dispatcher != "ring_expert") or dispatcher == "auto"


EXPLICIT = ("shard_map over every axis, Explicit", "shard_map over data, Explicit")  # the Auto mesh's, placed first
CASES = [pytest.param(kind, d, id=f"{kind}-{d}", marks=pytest.mark.slow if _slow(kind, d) else ())
         for kind in BLOCKS for d in DISPATCHERS]


@pytest.mark.parametrize("kind, dispatcher", CASES)
def test_a_users_block_is_the_oracle_under_every_dispatcher(kind, dispatcher):
  """Values and the gradients of x, the router and every expert weight, within 1e-5 of the dense float32 oracle."""
  make, shape = BLOCKS[kind]
  y, grads = rmt.block_values_and_grads(make(dispatcher), _tokens(1, shape))
  errors = rmt.assert_trees_close(dict(y=y, **grads), _oracle(kind), RTOL)
  names = {"router_DE", "w_gate_EDF", "w_up_EDF", "w_down_EFD"}
  assert set(errors["params"]) == (names if kind == "equinox" else set(_weights(0))), errors  # every one compared


def test_inside_a_users_shard_map_the_oracle_is_the_one_outside():
  """The same block and weights inside a shard_map (either form: the oracle per device, by all-gathers) and
  outside it (global arrays): values and every gradient."""
  for kind in ("shard_map over every axis", "shard_map over data", *EXPLICIT):
    rmt.assert_trees_close(_oracle(kind), _oracle("plain"), RTOL)


@pytest.mark.parametrize("kind", ["the oracle runs every moe_ffn", "a jit inside serves a cached trace"])
def test_the_block_check_catches_a_broken_dispatcher_and_a_cached_trace(kind):
  """The whole-block check names the swapped experts of a broken dispatcher in one short line, and refuses a
  block whose inner jit hides its moe_ffn (the oracle would be the block itself)."""
  if kind == "the oracle runs every moe_ffn":  # an Equinox module given to the layer form goes to the block form
    block = _equinox_block(SwappedExperts())
    with pytest.raises(AssertionError, match=r"^relative error over rtol=1e-05: .*params\.w_down_EFD .*experts that "
                                             r"differ: \[2, 5\]; token rows that differ: \[\d[^;]*$"):
      rmt.assert_layer_matches_dense_oracle(block, _tokens(1), rtol=RTOL)
    return
  mesh = mesh_of((2, 4), DATA_EXPERT)
  jitted = jax.jit(functools.partial(plain_block, dispatcher="ring_expert", mesh=mesh))
  jitted(_weights(2), _tokens(1, (32, D)))  # traced once, before the check
  with pytest.raises(ValueError, match=r"^Partial\(.*ran no moe_ffn while traced: .*pass the block without its jit$"):
    rmt.assert_block_matches_dense_oracle(jax.tree_util.Partial(jitted, _weights(2)), _tokens(1, (32, D)), rtol=RTOL)


class SwappedExperts:
  """A dispatcher with a bug: experts 2 and 5 swapped in the weights it computes with."""

  def __call__(self, x_TD, idx_TK, w_TK, *weights, layout):
    perm = jnp.array([0, 1, 5, 3, 4, 2, 6, 7])
    return rm.Dense()(x_TD, idx_TK, w_TK, *(w[perm] for w in weights), layout=layout)


class EquinoxExperts(eqx.Module):
  """Expert weights as fields; `ffn` has `moe_ffn`'s positional signature (a bound method holds arrays, so it is
  not hashable)."""

  mesh: jax.sharding.Mesh = eqx.field(static=True)

  def ffn(self, *arrays):
    return rm.moe_ffn(*arrays, mesh=self.mesh, dispatcher="ring_expert")


def test_an_equinox_bound_method_is_a_block_of_the_function_form():
  mesh = mesh_of((4,), (rm.EXPERT,))
  inputs = rmt.random_moe_inputs(0, tokens=32, d_model=D, d_ff=F, num_experts=E, top_k=K)
  errors = rmt.assert_matches_dense_oracle(EquinoxExperts(mesh).ffn, mesh=mesh, rtol=RTOL, **inputs)
  assert max(errors.values()) <= RTOL


def test_replicated_expert_weights_are_refused():
  """Every device holding every expert is refused, naming the array and the placement to give: a concrete array
  on the mesh, a traced one on Explicit axes, and one replicated over the expert axis of the user's shard_map."""
  mesh = mesh_of((2, 4), DATA_EXPERT, explicit=True)
  inputs = rmt.random_moe_inputs(0, tokens=32, d_model=D, d_ff=F, num_experts=E, top_k=K)
  replicated = {n: jax.device_put(a, NamedSharding(mesh, P())) for n, a in inputs.items()}
  message = r"^w_gate_EDF \(8, 8, 12\) is not split over expert axis 'expert' \(its sharding: P\(.*\)\): every device"
  with pytest.raises(ValueError, match=message):
    rm.moe_ffn(*replicated.values(), mesh=mesh)
  with pytest.raises(ValueError, match=message):
    jax.jit(lambda *a: rm.moe_ffn(*a, mesh=mesh))(*replicated.values())
  tokens, experts = P(DATA_EXPERT), P()
  in_shard_map = jax.shard_map(lambda *a: rm.moe_ffn(*a), mesh=mesh_of((2, 4), DATA_EXPERT),
                               in_specs=(tokens,) * 3 + (experts,) * 3, out_specs=tokens)
  with pytest.raises(ValueError, match=r"^w_gate_EDF \(8, 8, 12\) is replicated over expert axis 'expert' inside your "
                                       r"shard_map: every device holds all 8 experts. .*in_specs P\('expert'\)"):
    jax.jit(in_shard_map)(*inputs.values())


@pytest.mark.parametrize("case, message", [
    ("tokens replicated over data", r"^x_TD is replicated over token axis 'data' inside your shard_map"),
    ("tensor axis", r"^tensor_axis='data' is not supported inside a shard_map"),
    ("another mesh", r"^mesh= has axes \{'expert': 8\}, but the enclosing shard_map runs on \{'data': 2, 'expert': 4\}"),
    ("out_sharding", r"^out_sharding=\S*'data'\S* is not taken inside a shard_map"),
])
def test_what_cannot_run_inside_a_users_shard_map_is_one_line(case, message):
  mesh = mesh_of((2, 4), DATA_EXPERT)
  inputs = rmt.random_moe_inputs(0, tokens=32, d_model=D, d_ff=F, num_experts=E, top_k=K)
  tokens = P(rm.EXPERT) if case == "tokens replicated over data" else P(DATA_EXPERT)
  options = dict(tensor_axis=rm.DATA, token_axes=(rm.EXPERT,)) if case == "tensor axis" else {}
  if case == "another mesh":
    options = dict(mesh=mesh_of((8,), (rm.EXPERT,)))
  experts, names = P(rm.EXPERT), {rm.DATA, rm.EXPERT}
  if case == "out_sharding":  # over the data axis only
    options, tokens, experts, names = dict(out_sharding=P(rm.DATA)), P(rm.DATA), P(), {rm.DATA}
  block = jax.shard_map(lambda *a: rm.moe_ffn(*a, **options), mesh=mesh, in_specs=(tokens,) * 3 + (experts,) * 3,
                        out_specs=tokens, axis_names=names)
  with pytest.raises(ValueError, match=message):
    jax.jit(block)(*inputs.values())


def test_vmap_over_the_expert_weights_gets_its_own_advice():
  mesh = mesh_of((4,), (rm.EXPERT,))
  inputs = rmt.random_moe_inputs(0, tokens=32, d_model=D, d_ff=F, num_experts=E, top_k=K)
  members = {n: jnp.stack([a, a]) for n, a in inputs.items() if n.startswith("w_") and n != "w_TK"}
  ensemble = jax.vmap(lambda w: rm.moe_ffn(inputs["x_TD"], inputs["idx_TK"], inputs["w_TK"], **w, mesh=mesh))
  with pytest.raises(ValueError, match=r"cannot run under jax.vmap over its expert weights \(an ensemble of blocks\)"):
    ensemble(members)
