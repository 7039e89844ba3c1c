"""The chunked loss head against the plain one (optax over full float32 logits), values and gradients, with the
vocabulary whole or split over the tensor axis; its memory (compile-only); and the model's remat policies, which
must all compute the same loss and gradients, `offload` keeping the layer input in host memory."""

import contextlib
import dataclasses
import io
import math
import re
import threading
import unittest.mock

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.ad_checkpoint import print_saved_residuals
from jax.sharding import NamedSharding, PartitionSpec as P

from conftest import assert_close, jaxpr_equations, mesh_of
from models.qwen3 import model as qwen3
from models.loss import chunked_cross_entropy, mean_cross_entropy, plain_mean_cross_entropy
from models.qwen3.config import load_config
from models.runtime import DEFAULT_LOSS_CHUNK_TOKENS, REMAT_POLICIES, RuntimeConfig
from train.compile import memory_plan
from train.config import MeshConfig, RunConfig, load_run_config
from train.plan import loss_chunk
from train.plan.loss_chunk import SAME_BYTES, candidates, resolve_loss_chunk, widest, with_loss_chunk
from train.mesh import build_mesh

TOKEN_AXES = ("data", "expert")
LOSS_RTOL = 1e-6  # float32: only the summation order differs


def _plain(x, head, labels):
  logits = jnp.dot(x, head.astype(x.dtype), preferred_element_type=jnp.float32, precision="highest")
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels)


CASES = [  # mesh shape, token axes, sequence axis, vocabulary axis, chunk tokens, vocabulary tile
    # 10 tokens per device: 5 positions of the local batch of 2, a tail chunk of 2 of 37; tiles 24 + 24 + 16 of 64
    ((2, 4, 1), TOKEN_AXES, None, None, 10, 24),
    ((2, 2, 2), TOKEN_AXES, None, "tensor", 16, 12),  # vocabulary split over 'tensor': 32 columns per device
    ((2, 4, 1), TOKEN_AXES, None, None, 10_000, 10_000),  # one chunk, one tile
    # context parallelism: each sequence's 36 positions split over 'expert', 9 per device, chunks 4 + 4 + 1
    ((2, 4, 1), ("data",), "expert", None, 16, 24),
]


def _case(mesh_shape, token_axes, sequence_axis, vocab_axis, chunk_tokens, vocab_tile, seq_len=37):
  mesh = mesh_of(mesh_shape, TOKEN_AXES + ("tensor",))
  rng = np.random.default_rng(0)
  b, s, d, v = 8, seq_len - (seq_len % mesh.shape[sequence_axis] if sequence_axis else 0), 16, 64
  x = jnp.asarray(rng.normal(size=(b, s, d)), jnp.float32)
  head = jnp.asarray(rng.normal(size=(d, v)) / 4, jnp.float32)
  labels = jnp.asarray(rng.integers(0, v, (b, s)), jnp.int32)
  options = dict(mesh=mesh, token_axes=token_axes, sequence_axis=sequence_axis, vocab_axis=vocab_axis,
                 chunk_tokens=chunk_tokens, vocab_tile=vocab_tile)
  return x, head, labels, options


@pytest.mark.parametrize("case", CASES)
def test_chunked_loss_equals_the_plain_loss_and_its_gradients(case):
  x, head, labels, options = _case(*case)
  weights = jnp.asarray(np.random.default_rng(1).normal(size=labels.shape), jnp.float32)  # a per-token cotangent

  def chunked(x, head):
    return chunked_cross_entropy(x, head, labels, **options)

  assert_close(jax.jit(chunked)(x, head), _plain(x, head, labels), LOSS_RTOL, "per-token loss")
  weighted = lambda f: lambda x, head: jnp.sum(f(x, head) * weights)  # noqa: E731
  ours = jax.jit(jax.grad(weighted(chunked), (0, 1)))(x, head)
  ref = jax.jit(jax.grad(weighted(lambda x, head: _plain(x, head, labels)), (0, 1)))(x, head)
  for name, a, r in zip(("dx", "dhead"), ours, ref):
    assert a.dtype == r.dtype, name
    assert_close(a, r, LOSS_RTOL, name)


@pytest.mark.parametrize("case", CASES)
def test_mean_loss_with_its_gradient_from_the_forward_equals_the_plain_loss(case):
  """`mean_cross_entropy`: its value alone (the per-token forward, summed), and its value and gradients (computed
  in the forward, then scaled by the incoming cotangent, here 3) against the plain loss's."""
  x, head, labels, options = _case(*case)

  def ours(x, head):
    return 3 * mean_cross_entropy(x, head, labels, **options)

  def ref(x, head):
    return 3 * _plain(x, head, labels).mean()

  assert_close(jax.jit(ours)(x, head), ref(x, head), LOSS_RTOL, "loss")
  (value, grads), (ref_value, ref_grads) = (jax.jit(jax.value_and_grad(f, (0, 1)))(x, head) for f in (ours, ref))
  assert_close(value, ref_value, LOSS_RTOL, "loss, differentiated")
  for name, a, r in zip(("dx", "dhead"), grads, ref_grads):
    assert a.dtype == r.dtype, name
    assert_close(a, r, LOSS_RTOL, name)


@pytest.mark.parametrize("case", [CASES[0], CASES[3]], ids=["tokens", "context-parallel"])
def test_mean_loss_over_counted_targets_is_optax_weighted_mean(case):
  """With 0/1 `weights_BS` (packed documents' targets): Σ w · ce / Σ w, its value (alone and differentiated) and
  its gradients from the forward, against optax's over full float32 logits; and the full-logits path's. A weight
  left out of the sum, the count or the gradient fails here."""
  x, head, labels, options = _case(*case)
  weights = jnp.asarray(np.random.default_rng(2).random(labels.shape) < 0.7, jnp.float32)
  assert 0 < float(weights.sum()) < weights.size

  def ref(x, head):
    return 3 * jnp.sum(_plain(x, head, labels) * weights) / jnp.sum(weights)

  def ours(x, head):
    return 3 * mean_cross_entropy(x, head, labels, weights_BS=weights, **options)

  assert_close(jax.jit(ours)(x, head), ref(x, head), LOSS_RTOL, "loss")
  (value, grads), (ref_value, ref_grads) = (jax.jit(jax.value_and_grad(f, (0, 1)))(x, head) for f in (ours, ref))
  assert_close(value, ref_value, LOSS_RTOL, "loss, differentiated")
  for name, a, r in zip(("dx", "dhead"), grads, ref_grads):
    assert_close(a, r, LOSS_RTOL, name)
  logits = jnp.dot(x, head, precision="highest")
  assert_close(plain_mean_cross_entropy(logits, labels, weights), ref(x, head) / 3, LOSS_RTOL, "full logits")


def test_mean_loss_runs_three_bf16_matmuls_and_copies_nothing_per_chunk():
  """The differentiated bf16 loss: three dot_generals (logits, dx, dhead; no recompute), each bf16 × bf16 with
  float32 accumulation (no promotion of the operands); the compiled chunk loop copies no array (XLA:CPU's
  program: GPU fusions differ, but a copy of the head, a chunk or the accumulators would show here too)."""
  mesh = mesh_of((1, 1, 1), TOKEN_AXES + ("tensor",))
  x, head = jnp.zeros((4, 256, 32), jnp.bfloat16), jnp.zeros((32, 1024), jnp.bfloat16)
  labels = jnp.zeros((4, 256), jnp.int32)
  loss = lambda x, head, labels: mean_cross_entropy(x, head, labels, mesh=mesh, token_axes=TOKEN_AXES,  # noqa: E731
                                                    chunk_tokens=256)
  lowered = jax.jit(jax.value_and_grad(loss, (0, 1))).lower(x, head, labels)
  dots = [line for line in lowered.as_text().splitlines() if "dot_general" in line]
  assert len(dots) == 3, dots
  assert all(re.search(r"\(tensor<[0-9x]+xbf16>, tensor<[0-9x]+xbf16>\) -> tensor<[0-9x]+xf32>", d) for d in dots), dots
  program = lowered.compile().as_text()
  names = set(re.findall(r"body=(%[\w.-]+)", program))
  bodies = [c for c in re.split(r"\n(?=\S)", program) if c.split(" ", 1)[0] in names]
  assert bodies and len(bodies) == len(names), names
  copied = [[int(n) for n in m.group(1).split(",") if n] for body in bodies
            for m in re.finditer(r"= \S+\[([0-9,]*)\]\S* copy\(", body)]
  assert all(math.prod(shape) <= 4 * 64 for shape in copied), copied  # at most a number per token of the chunk


def test_chunked_loss_keeps_the_head_gradient_in_the_heads_dtype():
  """A float32 head with bfloat16 activations: the head's gradient comes back float32 (accumulated in float32),
  and close to the plain loss's (bfloat16 matmul inputs in both)."""
  mesh = mesh_of((2, 4, 1), TOKEN_AXES + ("tensor",))
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=(8, 32, 16)), jnp.bfloat16)
  head = jnp.asarray(rng.normal(size=(16, 128)) / 4, jnp.float32)
  labels = jnp.asarray(rng.integers(0, 128, (8, 32)), jnp.int32)
  chunked = lambda x, head: chunked_cross_entropy(x, head, labels, mesh=mesh, token_axes=TOKEN_AXES,  # noqa: E731
                                                  chunk_tokens=8).mean()
  dx, dhead = jax.jit(jax.grad(chunked, (0, 1)))(x, head)
  ref_dx, ref_dhead = jax.jit(jax.grad(lambda x, head: _plain(x, head, labels).mean(), (0, 1)))(x, head)
  assert (dx.dtype, dhead.dtype) == (jnp.bfloat16, jnp.float32)
  assert_close(dx, ref_dx, 3e-2, "dx")
  assert_close(dhead, ref_dhead, 3e-2, "dhead")


def test_chunked_loss_never_holds_the_full_logits():
  """Compile-only, one device: B·S = 4096 tokens over a vocabulary of 8192 (full float32 logits 128 MiB, and as
  much again for their gradient); chunks of 256 tokens need a small fraction of that."""
  mesh = mesh_of((1, 1, 1), TOKEN_AXES + ("tensor",))
  b, s, d, v = 4, 1024, 64, 8192
  spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P()))  # noqa: E731
  args = (spec((b, s, d), jnp.float32), spec((d, v), jnp.float32), spec((b, s), jnp.int32))

  def temps(loss):
    return jax.jit(jax.grad(lambda x, h, l: loss(x, h, l).mean(), (0, 1))).lower(*args).compile() \
        .memory_analysis().temp_size_in_bytes

  plain = temps(_plain)
  chunked = temps(lambda x, h, l: chunked_cross_entropy(x, h, l, mesh=mesh, token_axes=TOKEN_AXES, chunk_tokens=256))
  full_logits, chunk_logits = b * s * v * 4, 256 * v * 4
  assert plain >= full_logits, plain
  assert chunked <= 3 * chunk_logits and chunked * 4 <= full_logits, (chunked, chunk_logits, full_logits)


@pytest.fixture(scope="module")
def model_setup():
  mesh = build_mesh(MeshConfig(data=2, expert=4))
  config = load_config("tiny", num_hidden_layers=2)
  runtime = RuntimeConfig(loss_chunk_tokens=0, dtype="float32")
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, config.vocab_size, (8, 33)), jnp.int32)
  params = nnx.to_pure_dict(nnx.state(qwen3.create_sharded(config, mesh, seed=0, runtime=runtime)))
  return mesh, config, runtime, tokens, params


def _model_loss(config, runtime, mesh, tokens):
  graphdef, _ = qwen3.abstract(config, mesh, runtime=runtime)

  def loss(params):
    ce, aux = nnx.merge(graphdef, nnx.State(params)).cross_entropy_and_aux(tokens[:, :-1], tokens[:, 1:])
    return ce.mean() + 0.01 * aux["load_balancing_loss"]

  return loss


@pytest.mark.slow  # compiles a step of its own (~10-15 s on 2 cores); CI's second step runs it
def test_model_loss_is_the_same_chunked_and_under_every_remat_policy(model_setup):
  """Full logits with nothing recomputed against chunks of 24 tokens per device (a tail chunk) with the whole layer
  recomputed in layer 0 and its input offloaded in layer 1. (Policies inside scanned stretches: test_model.)"""
  mesh, config, runtime, tokens, _ = model_setup
  runtime = dataclasses.replace(runtime, scan_layers=False)
  params = nnx.to_pure_dict(nnx.state(qwen3.create_sharded(config, mesh, seed=0, runtime=runtime)))
  ref_value, ref_grads = jax.jit(jax.value_and_grad(_model_loss(config, runtime, mesh, tokens)))(params)
  frugal = dataclasses.replace(runtime, loss_chunk_tokens=24, remat=("layer", "offload"))
  value, grads = jax.jit(jax.value_and_grad(_model_loss(config, frugal, mesh, tokens)))(params)
  assert abs(float(value) - float(ref_value)) <= 1e-6 * abs(float(ref_value))
  for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads)):
    assert_close(g, r, 1e-5, jax.tree_util.keystr(path))


@pytest.mark.slow  # compiles two steps of five layers (~30 s on 2 cores)
def test_every_remat_policy_keeps_the_loss_to_1e_6_and_every_gradient_to_2e_6():
  """docs/memory.md's claim: chunked, each of the five layers under another remat policy (`REMAT_POLICIES`), the
  value and every gradient equal full logits with nothing recomputed, to 1e-6 relative (float32); the parameters'
  gradients to 2e-6: summed over five layers in an order XLA's fusion of the whole step decides (one k_norm weight's
  reached 1.07e-6 when `offload` became a custom VJP); a lost term of a gradient is 1e-3 and more."""
  mesh = build_mesh(MeshConfig(data=2, expert=4))
  config = load_config("tiny", num_hidden_layers=len(REMAT_POLICIES))
  runtime = RuntimeConfig(loss_chunk_tokens=0, dtype="float32", scan_layers=False)
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, config.vocab_size, (8, 33)), jnp.int32)
  params = nnx.to_pure_dict(nnx.state(qwen3.create_sharded(config, mesh, seed=0, runtime=runtime)))
  ref_value, ref_grads = jax.jit(jax.value_and_grad(_model_loss(config, runtime, mesh, tokens)))(params)
  every = dataclasses.replace(runtime, loss_chunk_tokens=24, remat=REMAT_POLICIES)
  value, grads = jax.jit(jax.value_and_grad(_model_loss(config, every, mesh, tokens)))(params)
  assert abs(float(value) - float(ref_value)) <= 1e-6 * abs(float(ref_value))
  for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads)):
    assert_close(g, r, 2e-6, jax.tree_util.keystr(path))


MODEL_CASES = {  # mesh, runtime changes
    "2x4": (MeshConfig(data=2, expert=4), {}),
    "fsdp-2x4": (MeshConfig(data=2, expert=4), dict(fsdp=True)),
    "context_parallel-2x4": (MeshConfig(data=2, expert=4), dict(context_parallel=True)),
    "vocab_over_tensor-2x2x2": (MeshConfig(data=2, expert=2, tensor=2), {}),
}


@pytest.mark.slow  # compiles the model twice per case (~20 s on 2 cores); CI's second step runs them
@pytest.mark.parametrize("case", MODEL_CASES)
def test_model_mean_loss_from_the_forward_gradient_equals_the_plain_loss(case):
  """The trainer's loss (`mean_cross_entropy_and_aux`, chunks of 12 tokens per device: tail chunks) against full
  logits: the loss and the gradient of every parameter, float32."""
  mesh_config, changes = MODEL_CASES[case]
  mesh = build_mesh(mesh_config)
  config = load_config("tiny", num_hidden_layers=2)
  runtime = RuntimeConfig(loss_chunk_tokens=0, dtype="float32", **changes)
  tokens = jnp.asarray(np.random.default_rng(5).integers(0, config.vocab_size, (8, 33)), jnp.int32)
  params = nnx.to_pure_dict(nnx.state(qwen3.create_sharded(config, mesh, seed=0, runtime=runtime)))

  def value_and_grads(runtime):
    graphdef, _ = qwen3.abstract(config, mesh, runtime=runtime)

    def loss(params):
      ce, aux = nnx.merge(graphdef, nnx.State(params)).mean_cross_entropy_and_aux(tokens[:, :-1], tokens[:, 1:])
      return ce + 0.01 * aux["load_balancing_loss"]

    return jax.jit(jax.value_and_grad(loss))(params)

  ref_value, ref_grads = value_and_grads(runtime)
  value, grads = value_and_grads(dataclasses.replace(runtime, loss_chunk_tokens=12))
  assert abs(float(value) - float(ref_value)) <= LOSS_RTOL * abs(float(ref_value))
  for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads)):
    assert_close(g, r, 1e-5, jax.tree_util.keystr(path))


@pytest.mark.parametrize("policy,on_host", [("offload", True), ("layer", False)])
def test_offload_keeps_only_the_layer_inputs_and_keeps_them_on_the_host(model_setup, policy, on_host):
  """What the step saves for backward (jaxpr level; XLA:CPU then ignores memory spaces, GPUs honour them): under
  `offload` the stacked layer inputs [layers, B, S, D] live in host memory, under `layer` on the device."""
  mesh, config, runtime, tokens, params = model_setup
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    print_saved_residuals(_model_loss(config, dataclasses.replace(runtime, remat=policy), mesh, tokens), params)
  b, s, d = tokens.shape[0], tokens.shape[1] - 1, config.hidden_size
  stacked_inputs = f"[{config.num_hidden_layers},{b},{s},{d}]"
  lines = [line for line in out.getvalue().splitlines() if stacked_inputs in line]
  assert lines, out.getvalue()
  assert all(("<host>" in line) == on_host for line in lines), lines


def test_offload_computes_what_keeping_everything_does_ordered_around_each_layers_host_copy(model_setup):
  """`offload`'s custom VJP: the loss and every gradient of keeping everything (float32), and two barriers with a
  host operand per traced layer (the scan traces its one): the forward's output waits for the host copy, the
  backward's fetch for the output's gradient. Without them XLA may keep each input on the device until backward.
  The recompute's matmuls at the model's precision (float32's HIGHEST: a GPU's default is TF32)."""
  mesh, config, runtime, tokens, params = model_setup
  losses = {policy: _model_loss(config, dataclasses.replace(runtime, remat=policy), mesh, tokens)
            for policy in ("none", "offload")}
  jaxpr = jax.make_jaxpr(jax.grad(losses["offload"]))(params)
  on_host = lambda v: getattr(v.aval, "memory_space", None) == jax.memory.Space.Host  # noqa: E731
  host_barriers = [e for e in jaxpr_equations(jaxpr.jaxpr)
                   if e.primitive.name == "optimization_barrier" and any(map(on_host, e.invars))]
  assert len(host_barriers) == 2, host_barriers
  precisions = {str(e.params["precision"]) for e in jaxpr_equations(jaxpr.jaxpr) if e.primitive.name == "dot_general"}
  assert precisions == {str((jax.lax.Precision.HIGHEST,) * 2)}, precisions
  ref_value, ref_grads = jax.jit(jax.value_and_grad(losses["none"]))(params)
  value, grads = jax.jit(jax.value_and_grad(losses["offload"]))(params)
  assert abs(float(value) - float(ref_value)) <= LOSS_RTOL * abs(float(ref_value))
  for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads)):
    assert_close(g, r, 1e-5, jax.tree_util.keystr(path))


@pytest.mark.gpu
def test_offload_on_a_gpu_moves_the_layer_inputs_to_the_host_and_changes_nothing():
  """On a GPU the offloaded inputs leave the device (host bytes in the compiled step) and the gradients equal
  those of keeping everything (XLA has had wrong-gradient bugs for offloaded scan residuals read backwards)."""
  if jax.default_backend() != "gpu":
    pytest.skip("offload to pinned host memory acts on GPUs; run `pytest -m gpu` there")
  mesh = build_mesh(MeshConfig(data=1, expert=1), jax.devices()[:1])
  config = load_config("tiny", num_hidden_layers=3)
  runtime = RuntimeConfig(dispatcher="ring_expert", dtype="float32")
  tokens = jnp.asarray(np.random.default_rng(4).integers(0, config.vocab_size, (2, 65)), jnp.int32)
  params = nnx.to_pure_dict(nnx.state(qwen3.create_sharded(config, mesh, seed=0, runtime=runtime)))
  results = {}
  for policy in ("none", "offload"):
    step = jax.jit(jax.value_and_grad(_model_loss(config, dataclasses.replace(runtime, remat=policy), mesh, tokens)))
    compiled = step.lower(params).compile()
    results[policy] = compiled(params), compiled.memory_analysis()
  (ref_value, ref_grads), _ = results["none"]
  (value, grads), memory = results["offload"]
  assert memory.host_temp_size_in_bytes > 0, memory
  assert abs(float(value) - float(ref_value)) <= 1e-6 * abs(float(ref_value))
  for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads)):
    assert_close(g, r, 1e-5, jax.tree_util.keystr(path))


CHUNKS = [2048, 4096, 8192, 16384, 32768, 65536]
BYTES_AT = {1024: 100, 2048: 100, 4096: 100 + SAME_BYTES, 8192: 100 + SAME_BYTES + 1, 16384: 3 * SAME_BYTES,
            32768: 4 * SAME_BYTES, 65536: 5 * SAME_BYTES}


@pytest.mark.parametrize("workers,rounds", [(1, 3), (2, 2), (6, 1)])
def test_the_widest_loss_chunk_is_the_largest_that_needs_no_more_memory(workers, rounds):
  """A search over the candidates (bytes grow with the chunk) in rounds of `workers` chunks at once: the largest
  within the default's bytes (and the few bytes a compile may differ by), in as few rounds as a search of that width
  needs, and told which chunk is the largest still in question (the one to compile to run)."""
  asked = []

  def bytes_of(chunk, last):
    asked.append((chunk, last))
    return BYTES_AT[chunk]

  with unittest.mock.patch("train.plan.loss_chunk.at_once", side_effect=lambda calls, w: [c() for c in calls]) as at:
    assert widest(BYTES_AT[1024], CHUNKS, bytes_of, workers) == 4096
  assert at.call_count == rounds and all(len(call.args[0]) <= workers for call in at.call_args_list), asked
  # `last` marks the chunk asked about that was the largest not yet excluded: in one round the largest candidate.
  assert [chunk for chunk, last in asked if last] == {1: [4096], 2: [8192], 6: [65536]}[workers], asked
  assert widest(100, CHUNKS, lambda chunk, last: 100, workers) == 65536
  assert widest(100, CHUNKS, lambda chunk, last: 10**9, workers) == DEFAULT_LOSS_CHUNK_TOKENS
  assert widest(100, CHUNKS, lambda chunk, last: 100 + (chunk > 16384) * 10**9, workers) == 16384


def test_the_loss_chunk_search_runs_the_step_it_compiled_to_run(monkeypatch):
  """With three candidates and three compiles at once on a GPU: one round, in threads, the largest compiled to run
  (the others for memory only); where it fits the trainer gets that step, where it does not, none (compiled later)."""
  run = RunConfig(model="tiny", mesh=MeshConfig(data=2, expert=4), batch_size=16, seq_len=4096)
  assert candidates(run) == [2048, 4096, 8192]
  compiled = []

  def compile_step(config, devices=None, memory_only=False, **resolved):
    compiled.append((config.runtime.loss_chunk_tokens, memory_only, threading.current_thread().name))
    return config.runtime.loss_chunk_tokens, memory_only

  for name, value in (("compile_step", compile_step), ("concurrent_compiles", lambda devices=None: 3),
                      ("memory_only_options", lambda devices=None: {"xla_gpu_autotune_level": 0})):
    monkeypatch.setattr(loss_chunk, name, value)
  for largest_fits in (True, False):
    compiled.clear()
    bytes_at = {2048: 100, 4096: 100, 8192: 100 if largest_fits else 100 + 2 * SAME_BYTES}
    monkeypatch.setattr(loss_chunk, "memory_plan", lambda config, step: {"total_bytes": bytes_at[step[0]]})
    resolved, step = resolve_loss_chunk(run, base_bytes=100, log=lambda *_: None)
    assert sorted(c[:2] for c in compiled) == [(2048, True), (4096, True), (8192, False)]
    assert threading.current_thread().name not in {c[2] for c in compiled}
    chunk = resolved.runtime.loss_chunk_tokens
    assert (chunk, step) == ((8192, (8192, False)) if largest_fits else (4096, None))


def test_the_loss_chunk_search_finds_the_round_compiled_ahead_done(monkeypatch):
  """The first round's compiles given to the remat plan (`ChunkSteps.ahead`), run before the search, are the
  search's: it compiles nothing again, and runs the largest's step."""
  run = RunConfig(model="tiny", mesh=MeshConfig(data=2, expert=4), batch_size=16, seq_len=4096)
  compiled = []

  def compile_step(config, devices=None, memory_only=False, **resolved):
    compiled.append((config.runtime.loss_chunk_tokens, memory_only))
    return config.runtime.loss_chunk_tokens, memory_only

  for name, value in (("compile_step", compile_step), ("concurrent_compiles", lambda devices=None: 3),
                      ("memory_only_options", lambda devices=None: {"xla_gpu_autotune_level": 0}),
                      ("memory_plan", lambda config, step: {"total_bytes": 100})):
    monkeypatch.setattr(loss_chunk, name, value)
  steps = loss_chunk.ChunkSteps()
  for call in steps.ahead(run):
    call()
  assert sorted(compiled) == [(2048, True), (4096, True), (8192, False)]
  resolved, step = resolve_loss_chunk(run, base_bytes=100, log=lambda *_: None, compiles=steps)
  assert len(compiled) == 3 and (resolved.runtime.loss_chunk_tokens, step) == (8192, (8192, False))
  assert loss_chunk.ChunkSteps().ahead(with_loss_chunk(run, 1024)) == []  # a chunk given: no search


def test_loss_chunk_candidates_double_up_to_the_tokens_per_device():
  def chunks(batch_size, seq_len):
    run = RunConfig(model="tiny", mesh=MeshConfig(data=2, expert=4), batch_size=batch_size, seq_len=seq_len)
    return candidates(run)

  assert chunks(16, 4096) == [2048, 4096, 8192]  # 8192 tokens per device
  assert chunks(64, 4096) == [2048, 4096, 8192]  # 32768: none past LARGEST_TOKENS
  assert chunks(8, 1500) == [1500]
  assert chunks(16, 512) == []  # 1024 tokens per device: the default holds them all


def test_loss_chunk_is_auto_unless_given():
  assert RuntimeConfig().loss_chunk_tokens == "auto" and RuntimeConfig().loss_chunk() == DEFAULT_LOSS_CHUNK_TOKENS
  run = load_run_config("cpu", ["runtime.loss_chunk_tokens=4096"])
  assert run.runtime.loss_chunk_tokens == 4096 and run.runtime.loss_chunk() == 4096
  assert RuntimeConfig(loss_chunk_tokens=0).loss_chunk() == 0
  with pytest.raises(ValueError, match="loss_chunk_tokens='big'"):
    RuntimeConfig(loss_chunk_tokens="big")


@pytest.mark.slow  # compiles the tiny model's step four times (~90 s on 2 cores)
def test_auto_loss_chunk_keeps_the_steps_memory(tmp_path):
  """2048 tokens per device: the step at the chosen chunk compiles to no more bytes than at the default, and a
  larger candidate, where there is one, to more."""
  run = RunConfig(model="tiny", model_overrides=dict(num_hidden_layers=1), mesh=MeshConfig(data=2, expert=4),
                  batch_size=8, seq_len=2048, runtime=RuntimeConfig(dtype="float32"), out_dir=str(tmp_path))
  resolved, step = resolve_loss_chunk(run, log=lambda *_: None)
  chunk = resolved.runtime.loss_chunk_tokens
  assert isinstance(chunk, int) and chunk in (DEFAULT_LOSS_CHUNK_TOKENS, *candidates(run))
  total = {c: memory_plan(with_loss_chunk(run, c))["total_bytes"] for c in (DEFAULT_LOSS_CHUNK_TOKENS, chunk)}
  assert total[chunk] <= total[DEFAULT_LOSS_CHUNK_TOKENS] + SAME_BYTES, total
  assert step is None or step.runtime.loss_chunk_tokens == chunk  # on CPUs every candidate's step can run
  larger = [c for c in candidates(run) if c > chunk]
  if larger:
    assert memory_plan(with_loss_chunk(run, larger[0]))["total_bytes"] > total[DEFAULT_LOSS_CHUNK_TOKENS] + SAME_BYTES
