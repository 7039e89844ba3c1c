"""The Qwen3-MoE model: its pieces against NumPy transcriptions of Hugging Face's math, and the whole model under
every dispatcher against the dense oracle (loss and all gradients)."""

import contextlib
import dataclasses
import functools
import io

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from conftest import CONTEXT_MESHES, assert_close, mesh_of, place_tokens, requires_devices
from models.qwen3 import model as qwen3
from models.qwen3.config import layer_groups, load_config
from models.runtime import RuntimeConfig
from train.config import MeshConfig
from train.mesh import build_mesh

MODEL_RTOL = 1e-4  # float32 through 2 layers: summation order differs between dispatchers
F32 = RuntimeConfig(dtype="float32")


@pytest.fixture(autouse=True)
def _eight_devices():
  """These tests build the trainer's (2 data × 4 expert) mesh: on a GPU machine run them with JAX_PLATFORMS=cpu."""
  requires_devices(8)


@pytest.fixture(scope="module")
def mesh():
  requires_devices(8)
  return build_mesh(MeshConfig(data=2, expert=4, tensor=1))


def test_rms_norm_matches_hf():
  rng = np.random.default_rng(0)
  x, w = rng.normal(size=(3, 5, 8)).astype(np.float32), rng.normal(size=(8,)).astype(np.float32)
  ref = w * (x / np.sqrt(np.mean(x ** 2, -1, keepdims=True) + 1e-6))
  np.testing.assert_allclose(np.asarray(qwen3.rms_norm(jnp.asarray(x), jnp.asarray(w), 1e-6)), ref, rtol=1e-5)


def test_rope_matches_hf_rotate_half():
  rng = np.random.default_rng(1)
  b, s, n, h, theta = 2, 7, 3, 8, 10000.0
  x = rng.normal(size=(b, s, n, h)).astype(np.float32)
  pos = np.tile(np.arange(s), (b, 1))
  inv_freq = 1.0 / theta ** (np.arange(0, h, 2) / h)
  emb = np.concatenate([pos[..., None] * inv_freq] * 2, -1)[:, :, None, :]
  rotate_half = np.concatenate([-x[..., h // 2:], x[..., :h // 2]], -1)
  ref = x * np.cos(emb) + rotate_half * np.sin(emb)
  np.testing.assert_allclose(np.asarray(qwen3.rope(jnp.asarray(x), jnp.asarray(pos), theta)), ref, atol=1e-5)


def _loss_and_grads(config, runtime, mesh, tokens, params):
  """(loss, gradients as a pure dict) of the model with `params` (a pure dict)."""
  graphdef, state = qwen3.abstract(config, mesh, runtime=runtime)
  nnx.replace_by_pure_dict(state, params)
  params = state

  def loss(params):
    logits, aux = nnx.merge(graphdef, params).logits_and_aux(tokens[:, :-1])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
    return ce + 0.01 * aux["load_balancing_loss"]

  value, grads = jax.jit(jax.value_and_grad(loss))(params)
  return value, nnx.to_pure_dict(grads)


VARIANTS = {  # (architecture changes, runtime changes, mesh)
    "qwen3": ({}, {}, MeshConfig(data=2, expert=4)),
    "qwen2": (dict(attention_bias=True, qk_norm=False, shared_expert_intermediate_size=32), {},
              MeshConfig(data=2, expert=4)),
    "qwen3-etp": ({}, dict(moe_tensor_parallel=True), MeshConfig(data=2, expert=2, tensor=2)),
    "qwen3-fsdp": ({}, dict(fsdp=True), MeshConfig(data=2, expert=4)),
}


DEFAULT_PAIRS = [("ring_expert", "qwen3")]  # each pair takes 12-14 s on 2 cores; CI's second step runs the rest
MODEL_PAIRS = [pytest.param(d, v, marks=() if (d, v) in DEFAULT_PAIRS else pytest.mark.slow)
               for d in ("ring_expert", "ring_token", "all_to_all") for v in sorted(VARIANTS)]


@pytest.mark.parametrize("dispatcher,variant", MODEL_PAIRS)
def test_model_under_dispatcher_matches_dense(dispatcher, variant):
  extra, runtime_extra, mesh_config = VARIANTS[variant]
  mesh = build_mesh(mesh_config)
  config = load_config("tiny", **extra)
  runtime = dataclasses.replace(F32, **runtime_extra)
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, config.vocab_size, (8, 17)), jnp.int32)
  params = nnx.to_pure_dict(nnx.state(qwen3.create_sharded(config, mesh, seed=0, runtime=runtime)))
  ref_value, ref_grads = _loss_and_grads(config, dataclasses.replace(runtime, dispatcher="dense"), mesh, tokens,
                                         params)
  value, grads = _loss_and_grads(config, dataclasses.replace(runtime, dispatcher=dispatcher), mesh, tokens, params)
  assert abs(float(value) - float(ref_value)) <= MODEL_RTOL * abs(float(ref_value))
  flat, ref_flat = jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads)
  assert len(flat) == len(ref_flat)
  for (path, g), r in zip(flat, ref_flat):
    assert_close(g, r, MODEL_RTOL, jax.tree_util.keystr(path))


@pytest.mark.parametrize("scan_layers", [False, pytest.param(True, marks=pytest.mark.slow)])  # 5-7 s each
def test_layer_kinds_follow_sparse_step_and_mlp_only_layers(mesh, scan_layers):
  config = load_config("tiny", num_hidden_layers=5, decoder_sparse_step=2, mlp_only_layers=[3])
  model = qwen3.Qwen3MoE(config, dataclasses.replace(F32, scan_layers=scan_layers), mesh=mesh, rngs=nnx.Rngs(0))
  layers = [(getattr(b, qwen3.STACKED), b.count) if scan_layers else (b, 1) for b in model.layers]
  kinds = [type(layer.mlp).__name__ for layer, count in layers for _ in range(count)]
  assert kinds == ["DenseMLP", "MoE", "DenseMLP", "DenseMLP", "DenseMLP"]
  assert len(model.layers) == (3 if scan_layers else 5)  # the last three layers are one scan
  logits = nnx.jit(lambda m, t: m(t))(model, jnp.zeros((8, 8), jnp.int32))
  assert logits.shape == (8, 8, config.vocab_size) and logits.dtype == jnp.float32


def test_layer_groups_split_at_every_change_of_kind():
  config = load_config("tiny", num_hidden_layers=7, mlp_only_layers=[2])
  runtime = RuntimeConfig(remat=("none",) * 3 + ("attention",) * 2 + ("none",) * 2)
  assert layer_groups(config, runtime) == [(0, 2, 1), (2, 1, 1), (3, 2, 1), (5, 2, 1)]
  assert layer_groups(config, dataclasses.replace(runtime, scan_layers=False)) == [(i, 1, 1) for i in range(7)]


def _spec(p):
  s = tuple(p[...].sharding.spec)
  return s + (None,) * (p[...].ndim - len(s))


def test_parameters_follow_the_sharding_table(mesh):
  model = qwen3.create_sharded(load_config("tiny"), mesh, runtime=RuntimeConfig(scan_layers=False))
  moe = model.layers[0].mlp
  assert _spec(moe.w_gate_EDF) == ("expert", None, None) and _spec(moe.w_down_EFD) == ("expert", None, None)
  assert tuple(model.layers[0].attn.q_DH.out_sharding) == (None, "tensor")  # 'tensor' has size 1 here


@pytest.mark.slow  # ~6 s; the default run reached 9.6 min on 2 cores, over 10 on CI's; CI's second step runs it
def test_stacked_parameters_keep_their_sharding_behind_the_layer_axis(mesh):
  model = qwen3.create_sharded(load_config("tiny"), mesh)
  stack = getattr(model.layers[0], qwen3.STACKED)
  assert stack.mlp.w_gate_EDF[...].shape[0] == 2
  assert _spec(stack.mlp.w_gate_EDF) == (None, "expert", None, None)
  assert _spec(stack.mlp.w_down_EFD) == (None, "expert", None, None)
  assert tuple(stack.attn.q_DH.out_sharding) == (None, None, "tensor")
  fsdp = getattr(qwen3.create_sharded(load_config("tiny"), mesh, runtime=RuntimeConfig(fsdp=True)).layers[0],
                 qwen3.STACKED)
  assert _spec(fsdp.attn.q_DH) == (None, ("data", "expert"), None)
  assert _spec(fsdp.mlp.w_gate_EDF) == (None, "expert", None, None)


@pytest.mark.slow  # compiles a step of its own (~10-15 s on 2 cores); CI's second step runs it
def test_scanned_layers_compute_what_the_unrolled_layers_do(mesh):
  """The same parameters, stacked: the same loss and, stacked, the same gradients (float32), over stretches of
  MoE and dense layers under every remat policy. (The dispatchers inside a scan: the tests above, whose tiny model is one
  stretch of two MoE layers.)"""
  config = load_config("tiny", num_hidden_layers=5, mlp_only_layers=[2, 3])
  runtime = dataclasses.replace(F32, dispatcher="dense", remat=("layer", "attention", "none", "all_but_attention",
                                                                "offload"),
                                scan_layers=False)
  tokens = jnp.asarray(np.random.default_rng(3).integers(0, config.vocab_size, (8, 17)), jnp.int32)
  params = nnx.to_pure_dict(nnx.state(qwen3.create_sharded(config, mesh, seed=0, runtime=runtime)))
  unrolled_value, unrolled = _loss_and_grads(config, runtime, mesh, tokens, params)
  scanned = dataclasses.replace(runtime, scan_layers=True)
  stacked = lambda layers: jax.tree.map(lambda *p: jnp.stack(p), *layers)  # noqa: E731
  scanned_params = dict(params, layers={g: {qwen3.STACKED: stacked([params["layers"][i] for i in range(f, f + n)])}
                                        for g, (f, n, _) in enumerate(layer_groups(config, scanned))})
  value, scanned_grads = _loss_and_grads(config, scanned, mesh, tokens, scanned_params)
  assert abs(float(value) - float(unrolled_value)) <= 1e-6 * abs(float(unrolled_value))
  expected = dict(unrolled, layers={g: {qwen3.STACKED: stacked([unrolled["layers"][i] for i in range(f, f + n)])}
                                    for g, (f, n, _) in enumerate(layer_groups(config, scanned))})
  flat = jax.tree_util.tree_leaves_with_path(scanned_grads)
  ref_flat = jax.tree_util.tree_leaves_with_path(expected)
  assert [p for p, _ in flat] == [p for p, _ in ref_flat]
  for (path, g), (_, r) in zip(flat, ref_flat):
    assert_close(g, r, 1e-5, jax.tree_util.keystr(path))


def _saved_residuals(config, runtime, mesh, tokens, params):
  graphdef, state = qwen3.abstract(config, mesh, runtime=runtime)
  nnx.replace_by_pure_dict(state, params)
  lines = io.StringIO()
  with contextlib.redirect_stdout(lines):
    jax.ad_checkpoint.print_saved_residuals(lambda p: nnx.merge(graphdef, p)(tokens).mean(), state)
  return lines.getvalue().splitlines()


def test_all_but_attention_keeps_only_what_the_attention_kernel_made(mesh):
  """Context-parallel attention's output and logsumexp stay for backward under `all_but_attention` (one of each per
  layer) and under `layer` do not; q, k and v ([B, S, Q, Z] too) are recomputed under both. (cuDNN's own attention
  is kept by its primitive: `pytest -m gpu`.)"""
  config = load_config("tiny", num_hidden_layers=2)
  runtime = dataclasses.replace(F32, context_parallel=True, scan_layers=False)
  tokens = jnp.asarray(np.random.default_rng(4).integers(0, config.vocab_size, (8, 32)), jnp.int32)
  params = nnx.to_pure_dict(nnx.state(qwen3.create_sharded(config, mesh, seed=0, runtime=runtime)))
  output = f"f32[8,32,{config.num_attention_heads},{config.head_dim}]"
  kept = {policy: _saved_residuals(config, dataclasses.replace(runtime, remat=policy), mesh, tokens, params)
          for policy in ("layer", "all_but_attention")}
  assert sum(line.startswith(output) for line in kept["all_but_attention"]) == 2
  assert not any(line.startswith(output) for line in kept["layer"])
  assert len(kept["all_but_attention"]) == len(kept["layer"]) + 4  # and a logsumexp per layer


@pytest.mark.slow  # compiles the model twice (~25 s on 2 cores)
def test_all_but_attention_computes_what_keeping_everything_does(mesh):
  """Context parallelism, where the kept outputs feed attention's own backward: loss and gradients (float32)."""
  config = load_config("tiny", num_hidden_layers=2)
  runtime = dataclasses.replace(F32, context_parallel=True, scan_layers=False)
  tokens = jnp.asarray(np.random.default_rng(4).integers(0, config.vocab_size, (8, 33)), jnp.int32)
  params = nnx.to_pure_dict(nnx.state(qwen3.create_sharded(config, mesh, seed=0, runtime=runtime)))
  ref_value, ref = _loss_and_grads(config, runtime, mesh, tokens, params)
  value, grads = _loss_and_grads(config, dataclasses.replace(runtime, remat="all_but_attention"), mesh, tokens, params)
  assert abs(float(value) - float(ref_value)) <= 1e-6 * abs(float(ref_value))
  for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref)):
    assert_close(g, r, 1e-5, jax.tree_util.keystr(path))


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "qwen2-57b-a14b", "qwen3-235b-a22b", "grid-e128-k8-f768"])
def test_shipped_configs_load(name):
  config = load_config(name)
  assert config.num_experts % 8 == 0 and config.num_experts_per_tok <= config.num_experts


@pytest.mark.parametrize("changes,message", [
    (dict(num_experts_per_tok=9), "num_experts_per_tok=9"),
    (dict(num_key_value_heads=3), "num_key_value_heads=3"),
    (dict(hidden_sizes=64), "hidden_sizes"),
    (dict(scan_layers=False), "\\['scan_layers'\\] say how the model runs, not what it is"),
])
def test_bad_model_config_is_named(changes, message):
  with pytest.raises(ValueError, match=message):
    load_config("tiny", **changes)


def test_per_layer_remat_given_as_a_list_is_kept_as_a_tuple():
  assert RuntimeConfig(remat=["layer", "none"]).remat == ("layer", "none")
  with pytest.raises(ValueError, match="remat \\['everything'\\] unknown"):
    RuntimeConfig(remat=["layer", "everything"])


@pytest.mark.parametrize("changes,message", [
    (dict(dispatcher="ring_sideways"), "ring_sideways"),
    (dict(remat=("none",)), "remat has 1 entries"),
    (dict(remat="everything"), "remat \\['everything'\\] unknown"),
    (dict(remat="auto"), "remat=auto is resolved by the planner"),
    (dict(loss_chunk_tokens=-1), "loss_chunk_tokens=-1"),
])
def test_bad_runtime_is_named(changes, message, mesh):
  with pytest.raises(ValueError, match=message):
    qwen3.abstract(load_config("tiny"), mesh, runtime=RuntimeConfig(**changes))


@pytest.mark.slow  # 9 s on 2 cores (the default run reached 10.5 min on CI); CI's second step runs it
def test_the_model_runs_on_explicit_meshes_and_meshes_without_data_or_tensor(mesh):
  """The same parameters on the trainer's Auto mesh, on `jax.make_mesh`'s Explicit axes and on meshes that lack
  'data' or 'tensor' (taken as size 1): the same logits. A mesh without 'expert' is refused by name."""
  config = load_config("tiny")
  tokens = jnp.asarray(np.random.default_rng(5).integers(0, config.vocab_size, (8, 16)), jnp.int32)
  params = nnx.to_pure_dict(nnx.state(qwen3.create_sharded(config, mesh, seed=0, runtime=F32)))

  def logits_on(other):
    graphdef, state = qwen3.abstract(config, other, runtime=F32)
    shardings = jax.tree.map(lambda a: a.sharding, nnx.to_pure_dict(state))
    nnx.replace_by_pure_dict(state, jax.device_put(params, shardings))
    return np.asarray(nnx.jit(lambda m, t: m(t))(nnx.merge(graphdef, state), tokens))

  expected = logits_on(mesh)
  devices = jax.devices()[:8]
  for other in (jax.make_mesh((2, 4, 1), ("data", "expert", "tensor"), devices=devices),
                jax.make_mesh((2, 4), ("data", "expert"), devices=devices),
                jax.sharding.Mesh(np.array(devices), ("expert",))):
    np.testing.assert_allclose(logits_on(other), expected, rtol=1e-5, atol=1e-5, err_msg=str(other))
  with pytest.raises(ValueError, match="needs a mesh with an 'expert' axis"):
    qwen3.abstract(config, jax.make_mesh((8,), ("data",), devices=devices), runtime=F32)


@functools.cache
def _random_model(mesh_key=None):
  """(graphdef, random float32 parameters as NumPy, tokens) of the tiny model: no compile to make them."""
  config = load_config("tiny")
  rng = np.random.default_rng(7)
  _, state = qwen3.abstract(config, build_mesh(MeshConfig(data=2, expert=4)), runtime=F32)
  params = jax.tree.map(lambda a: (0.2 * rng.standard_normal(a.shape)).astype(np.float32), nnx.to_pure_dict(state))
  return config, params, rng.integers(0, config.vocab_size, (8, 16)).astype(np.int32)


def _logits_on(mesh, tokens):
  """The random tiny model's logits on `mesh` (its parameters placed as the model places them there)."""
  config, params, _ = _random_model()
  graphdef, state = qwen3.abstract(config, mesh, runtime=F32)
  nnx.replace_by_pure_dict(state, jax.device_put(params, jax.tree.map(lambda a: a.sharding,
                                                                      nnx.to_pure_dict(state))))
  return _logits(nnx.merge(graphdef, state), tokens)


_logits = nnx.jit(lambda model, tokens: model(tokens))


@functools.cache
def _no_context_logits():
  return np.asarray(_logits_on(build_mesh(MeshConfig(data=2, expert=4)), _random_model()[2]))


SET_MESH_DEFAULT = {("explicit", "rows"), ("expert-only-auto", "unsharded"), ("auto", "sequence"),
                    ("expert-only-explicit", "sequence")}  # each mesh and each placement once: ~3 s each
SET_MESH_CASES = [pytest.param(k, p, marks=() if (k, p) in SET_MESH_DEFAULT else pytest.mark.slow)
                  for k in sorted(CONTEXT_MESHES) for p in ("unsharded", "rows", "sequence")]


@pytest.mark.parametrize("kind,placement", SET_MESH_CASES)
def test_the_model_runs_under_jax_set_mesh(kind, placement):
  """Built and called under `jax.set_mesh` of an Explicit, expert-only or Auto mesh, on tokens unsharded or sharded
  over rows or sequence: the logits of the same parameters on an Auto mesh without context (float32, 1e-5), on the
  context's mesh with the batch over its token axes (the docstring's promise)."""
  shape, names, explicit = CONTEXT_MESHES[kind]
  mesh = mesh_of(shape, names, explicit=explicit)
  expected = _no_context_logits()
  with jax.set_mesh(mesh):
    logits = _logits_on(mesh, place_tokens(_random_model()[2], mesh, placement))
    batch_axes = tuple(a for a in ("data", "expert") if a in names)
    assert logits.sharding.mesh == mesh
    assert tuple(logits.sharding.spec)[:1] == (batch_axes[0] if len(batch_axes) == 1 else batch_axes,)
  np.testing.assert_allclose(np.asarray(logits), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # two eager constructions: ~12 s on 2 cores
def test_the_model_is_built_eagerly_under_jax_set_mesh():
  """`Qwen3MoE(...)` under an Explicit `jax.set_mesh` makes the parameters it makes without context."""
  mesh = mesh_of((2, 4), ("data", "expert"), explicit=True)
  config = load_config("tiny")
  expected = nnx.to_pure_dict(nnx.state(qwen3.Qwen3MoE(config, F32, mesh=mesh, rngs=nnx.Rngs(0))))
  with jax.set_mesh(mesh):
    built = nnx.to_pure_dict(nnx.state(qwen3.Qwen3MoE(config, F32, mesh=mesh, rngs=nnx.Rngs(0))))
  jax.tree.map(np.testing.assert_array_equal, built, expected)
