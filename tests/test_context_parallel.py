"""Context parallelism: each sequence split over 'expert' computes what the whole sequence on one device does.

Float32 on 8 emulated CPU devices; the reference is the same model (or `jax.nn.dot_product_attention`) without
context parallelism on the same mesh. Tolerance: 1e-5 relative (max |a − b| / max |b| per array), for summation
order only (observed ≤ 1e-6).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from conftest import assert_close, requires_devices
from models.qwen3 import model as qwen3
from models.attention.context_parallel import (XLA_TILES, balanced_order, context_attention, key_tiles_per_device,
                                               skipped_tiles, tile_loop_backward, tile_loop_forward, tile_rows,
                                               to_held_order, to_sequence_order)
from models.qwen3.config import load_config
from models.runtime import RuntimeConfig
from models.sharding import MESH_AXES
from train.config import MeshConfig, RunConfig
from relaymoe_jax.compiler import compiled_bytes
from train.compile import compile_step
from train.loop import run
from train.mesh import build_mesh, run_mesh

RTOL = 1e-5
F32 = RuntimeConfig(dtype="float32", loss_chunk_tokens=4)  # several loss chunks per device


@pytest.fixture(autouse=True)
def _eight_devices():
  requires_devices(8)


def test_device_i_holds_chunks_i_and_its_mirror():
  assert balanced_order(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
  x = jnp.arange(2 * 48 * 3).reshape(2, 48, 3)
  held = to_held_order(x, 3)
  assert (held == x[:, balanced_order(48, 3)]).all() and (to_sequence_order(held, 3) == x).all()


@pytest.mark.parametrize("seq_len, ring, tile", [(64, 4, 4), (48, 3, 2), (4096, 8, 128), (16, 8, 1)])
def test_every_device_does_the_same_attention_work(seq_len, ring, tile):
  """Counted as the kernel counts its (query tile, key tile) pairs; together they are exactly the causal ones."""
  work = key_tiles_per_device(seq_len, ring, tile)
  tiles = seq_len // tile
  assert len(set(work)) == 1, work
  assert sum(work) == tiles * (tiles + 1) // 2


def test_tiles_divide_the_chunk():
  assert tile_rows(2048) == 512 and tile_rows(96, 64) == 48 and tile_rows(7) == 7


def _mesh(data, expert, tensor=1):
  return jax.make_mesh((data, expert, tensor), MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3,
                       devices=jax.devices()[:data * expert * tensor])


@pytest.mark.parametrize("shape, query_heads, kv_heads, tile", [
    ((1, 2, 1), 4, 2, 4), ((2, 4, 1), 4, 2, 2), ((1, 8, 1), 2, 2, 4), ((1, 4, 2), 4, 2, 8)])
def test_attention_over_the_shards_is_causal_attention(shape, query_heads, kv_heads, tile):
  """Outputs and the gradients of q, k and v (GQA, heads over 'tensor' in the last case)."""
  mesh = _mesh(*shape)
  b, s, z = 2 * shape[0], 64, 8
  rng = np.random.default_rng(0)
  q, k, v, do = (jnp.asarray(rng.normal(size=(b, s, h, z)), jnp.float32)
                 for h in (query_heads, kv_heads, kv_heads, query_heads))
  order = balanced_order(s, shape[1])

  def sharded(q, k, v):
    return context_attention(q[:, order], k[:, order], v[:, order], mesh=mesh, scale=z ** -0.5,
                             tile=tile)[:, np.argsort(order)]

  def whole(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, scale=z ** -0.5, is_causal=True)

  (out, grads), (ref_out, ref_grads) = [_value_and_vjp(f, (q, k, v), do) for f in (sharded, whole)]
  assert_close(out, ref_out, RTOL, "out")
  for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
    assert_close(g, r, RTOL, name)


def _value_and_vjp(f, args, cotangent):
  out, vjp = jax.vjp(jax.jit(f), *args)
  return out, vjp(cotangent)


def _loss_logits_grads(config, runtime, mesh, tokens, params):
  graphdef, state = qwen3.abstract(config, mesh, runtime=runtime)
  nnx.replace_by_pure_dict(state, params)

  def loss(p):  # the trainer's: the mean cross-entropy's gradient computed in its forward
    ce, aux = nnx.merge(graphdef, p).mean_cross_entropy_and_aux(tokens[:, :-1], tokens[:, 1:])
    return ce + 0.01 * aux["load_balancing_loss"] + 0.001 * aux["router_z_loss"]

  value, grads = jax.jit(jax.value_and_grad(loss))(state)
  ce_BS = jax.jit(lambda p: nnx.merge(graphdef, p).cross_entropy_and_aux(tokens[:, :-1], tokens[:, 1:])[0])(state)
  logits = jax.jit(lambda p: nnx.merge(graphdef, p)(tokens[:, :-1]))(state)
  return value, ce_BS, logits, nnx.to_pure_dict(grads)


CASES = {  # dispatcher, mesh, runtime changes, architecture changes
    "ring_expert-2x4": ("ring_expert", MeshConfig(data=2, expert=4), {}, {}),
    "all_to_all-1x8": ("all_to_all", MeshConfig(data=1, expert=8), {}, {}),
    "ring_token-etp-2x2x2": ("ring_token", MeshConfig(data=2, expert=2, tensor=2), dict(moe_tensor_parallel=True),
                             {}),
    "ring_expert-unscanned-remat-4x2": ("ring_expert", MeshConfig(data=4, expert=2),
                                        dict(scan_layers=False, remat=("layer", "attention")), {}),
    "ring_expert-remat-qwen2-1x8": ("ring_expert", MeshConfig(data=1, expert=8), dict(remat="layer"),
                                    dict(attention_bias=True, qk_norm=False, shared_expert_intermediate_size=32)),
    "ring_token-2x4": ("ring_token", MeshConfig(data=2, expert=4), dict(remat="attention"), {}),
    "all_to_all-fsdp-2x4": ("all_to_all", MeshConfig(data=2, expert=4), dict(fsdp=True), {}),
}
# Each case compiles the model twice (~20 s on 2 cores): CI's second step runs one per dispatcher (with remat,
# expert-tensor parallelism and FSDP), `pytest -m full_grid` the rest; the default run checks CP through the
# held-out loss (test_evaluate.py).
SLOW_CASES = ("ring_expert-unscanned-remat-4x2", "ring_token-etp-2x2x2", "all_to_all-fsdp-2x4")


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow if c in SLOW_CASES else pytest.mark.full_grid)
                                  for c in CASES])
def test_the_model_with_context_parallelism_computes_what_it_does_without(case):
  """Loss (chunked cross-entropy and router losses), per-token cross-entropy, logits and every gradient."""
  dispatcher, mesh_config, runtime_changes, arch_changes = CASES[case]
  mesh = build_mesh(mesh_config)
  config = load_config("tiny", **arch_changes)
  runtime = dataclasses.replace(F32, dispatcher=dispatcher, **runtime_changes)
  tokens = jnp.asarray(np.random.default_rng(3).integers(0, config.vocab_size, (8, 17)), jnp.int32)
  params = nnx.to_pure_dict(nnx.state(qwen3.create_sharded(config, mesh, seed=0, runtime=runtime)))
  ref = _loss_logits_grads(config, runtime, mesh, tokens, params)
  got = _loss_logits_grads(config, dataclasses.replace(runtime, context_parallel=True), mesh, tokens, params)
  for name, g, r in zip(("loss", "ce_BS", "logits"), got[:3], ref[:3]):
    assert_close(g, r, RTOL, name)
  flat, ref_flat = jax.tree_util.tree_leaves_with_path(got[3]), jax.tree.leaves(ref[3])
  assert len(flat) == len(ref_flat)
  for (path, g), r in zip(flat, ref_flat):
    assert_close(g, r, RTOL, jax.tree_util.keystr(path))


@pytest.mark.slow
def test_plain_loss_over_full_logits_is_the_same_under_context_parallelism():
  mesh = build_mesh(MeshConfig(data=2, expert=4))
  config = load_config("tiny")
  runtime = dataclasses.replace(F32, loss_chunk_tokens=0)
  tokens = jnp.asarray(np.random.default_rng(4).integers(0, config.vocab_size, (8, 17)), jnp.int32)
  model = qwen3.create_sharded(config, mesh, seed=0, runtime=runtime)
  graphdef, state = nnx.split(model)
  cp_graphdef, _ = nnx.split(qwen3.create_sharded(config, mesh, seed=0,
                                                  runtime=dataclasses.replace(runtime, context_parallel=True)))
  ce = [jax.jit(lambda s, g=g: nnx.merge(g, s).cross_entropy_and_aux(tokens[:, :-1], tokens[:, 1:])[0])(state)
        for g in (cp_graphdef, graphdef)]
  assert_close(ce[0], ce[1], RTOL, "ce_BS")
  assert_close(ce[1], optax.softmax_cross_entropy_with_integer_labels(model(tokens[:, :-1]), tokens[:, 1:]), RTOL)


def _cp_run(tmp_path, name, context_parallel, **changes):
  runtime = dataclasses.replace(F32, context_parallel=context_parallel)
  return dataclasses.replace(RunConfig(model="tiny", runtime=runtime, mesh=MeshConfig(data=2, expert=4), batch_size=8,
                                       seq_len=32, steps=4, log_every=1, checkpoint_every=0,
                                       out_dir=str(tmp_path / name), tensorboard=False), **changes)


@pytest.mark.slow  # 13-29 s on 2 cores (the default run reached 11.5 min); CI's second step runs it
def test_training_with_context_parallelism_follows_the_same_losses(tmp_path):
  with_cp, reference = run(_cp_run(tmp_path, "cp", True)), run(_cp_run(tmp_path, "ref", False))
  assert [r["step"] for r in with_cp] == [0, 1, 2, 3]
  for a, b in zip(with_cp, reference):
    assert a["loss"] == pytest.approx(b["loss"], rel=RTOL)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=RTOL)


@pytest.mark.slow
def test_a_checkpoint_saved_without_context_parallelism_resumes_with_it(tmp_path):
  """The parameters live where they do without context parallelism: the resumed run continues the losses of a run
  that never switched."""
  straight = run(_cp_run(tmp_path, "straight", False))
  switched = _cp_run(tmp_path, "switched", False, checkpoint_every=2, steps=2)
  run(switched)
  resumed = run(dataclasses.replace(switched, steps=4, runtime=dataclasses.replace(F32, context_parallel=True)),
                resume=True)
  assert [r["step"] for r in resumed] == [2, 3]
  for a, b in zip(resumed, straight[2:]):
    assert a["loss"] == pytest.approx(b["loss"], rel=RTOL)


@pytest.mark.slow  # compiles a step of its own (~10-15 s on 2 cores); CI's second step runs it
def test_context_parallelism_over_one_expert_device_compiles_the_same_step(tmp_path):
  """Nothing is split over a ring of one: the step's FLOPs, bytes moved and memory are those without it."""
  steps = [compile_step(_cp_run(tmp_path, "one", cp, mesh=MeshConfig(data=8, expert=1))).compiled
           for cp in (True, False)]
  costs = [{k: c.cost_analysis()[k] for k in ("flops", "bytes accessed")} for c in steps]
  memory = [compiled_bytes(c) for c in steps]
  assert costs[0] == costs[1] and memory[0] == memory[1]


@pytest.mark.parametrize("changes, message", [
    (dict(seq_len=20), r"seq_len=20 is not a multiple of 8"),
    (dict(batch_size=3), r"batch_size=3 does not split over the mesh's 2 shards of rows \(data=2\)"),
    (dict(seq_len=8248), r"seq_len=8248 gives chunks of 1031 tokens, whose attention tiles would be 1 rows; use "
                         r"a multiple of 512"),
])
def test_a_sequence_or_batch_that_does_not_split_is_named(tmp_path, changes, message):
  with pytest.raises(ValueError, match=message):
    run_mesh(_cp_run(tmp_path, "bad", True, **changes))


def test_over_one_expert_device_any_sequence_length_trains_as_without(tmp_path):
  assert run_mesh(_cp_run(tmp_path, "odd", True, seq_len=33, mesh=MeshConfig(data=8, expert=1))).shape["expert"] == 1


def test_bfloat16_attention_over_the_shards_is_causal_attention_to_bfloat16_rounding():
  """Inputs, outputs and gradients in bfloat16 against float32 causal attention of the same (rounded) inputs:
  within 2e-2 relative (bfloat16 keeps 8 bits)."""
  mesh = _mesh(2, 4)
  rng = np.random.default_rng(1)
  q, k, v, do = (jnp.asarray(rng.normal(size=(4, 64, h, 8)), jnp.bfloat16) for h in (4, 2, 2, 4))
  order = balanced_order(64, 4)

  def sharded(q, k, v):
    return context_attention(q[:, order], k[:, order], v[:, order], mesh=mesh, scale=8 ** -0.5,
                             tile=4)[:, np.argsort(order)]

  def whole(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, scale=8 ** -0.5, is_causal=True)

  out, grads = _value_and_vjp(sharded, (q, k, v), do)
  as_f32 = [a.astype(jnp.float32) for a in (q, k, v, do)]
  ref_out, ref_grads = _value_and_vjp(whole, as_f32[:3], as_f32[3])
  assert out.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in grads)
  for name, g, r in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref_out, *ref_grads)):
    assert_close(g.astype(jnp.float32), r, 2e-2, name)


@pytest.mark.parametrize("changes, seq_len, message", [
    ({}, 12, "seq_len=12 is not a multiple of 8"),
    (dict(attention_implementation="cudnn"), 16, "'cudnn' under context parallelism: the devices are cpu, not GPUs")])
def test_the_model_names_a_sequence_or_kernel_that_cannot_attend(changes, seq_len, message):
  mesh = build_mesh(MeshConfig(data=2, expert=4))
  config = load_config("tiny")
  model = qwen3.create_sharded(config, mesh, runtime=dataclasses.replace(F32, context_parallel=True, **changes))
  with pytest.raises(ValueError, match=message):
    model(jnp.zeros((2, seq_len), jnp.int32))


def test_skipped_tiles_counts_what_a_document_cannot_see():
  """`skipped_tiles` by hand: one document skips nothing; documents within a tile skip every key tile before the
  query tile's (4 devices, chunks of 8, tiles of 4: 16 query tiles)."""
  s, ring, tile = 64, 4, 4
  assert skipped_tiles(np.zeros((2, s), np.int32), ring, tile) == [0] * ring
  within = np.broadcast_to(np.arange(s) // tile, (2, s))  # every tile a document: every key tile before it skipped
  query_tiles = s // ring // tile  # each computes its diagonal pair only
  assert skipped_tiles(within, ring, tile) == [n - query_tiles for n in key_tiles_per_device(s, ring, tile)]
  late = within.copy()
  late[1] = 0  # a row of one document: no row skips anything (the skip holds for every row of the batch)
  assert skipped_tiles(late, ring, tile) == [0] * ring
  halves = np.broadcast_to(np.arange(s) // (s // 2), (1, s))  # two documents: the second's tiles skip the first's
  assert sum(skipped_tiles(halves, ring, tile)) == (s // 2 // tile) ** 2


def test_context_parallel_tile_loop_skips_the_tiles_it_counts():
  """The tile loop's kernel calls, forward and backward, per device: its causal pairs less `skipped_tiles`; and
  the output and gradients are still the masked whole-row attention's."""
  requires_devices(4)
  s, ring, tile = 64, 4, 4
  mesh = build_mesh(MeshConfig(data=1, expert=ring), jax.devices()[:ring])
  rng = np.random.default_rng(5)
  q, k, v, do = (jnp.asarray(rng.normal(size=(1, s, h, 8)), jnp.float32) for h in (4, 2, 2, 4))
  segments = np.repeat(np.arange(s // 6 + 1), 6)[None, :s].astype(np.int32)  # documents of 6 tokens
  calls, kernels = _counted_xla_tiles()
  order = balanced_order(s, ring)

  def sharded(q, k, v):
    return context_attention(q[:, order], k[:, order], v[:, order], mesh=mesh, scale=8 ** -0.5, kernels=kernels,
                             tile=tile, segment_ids_BS=jnp.asarray(segments[:, order]))[:, np.argsort(order)]

  out, vjp = jax.vjp(jax.jit(sharded), q, k, v)
  grads = vjp(do)
  jax.block_until_ready(grads)
  expected = sum(key_tiles_per_device(s, ring, tile)) - sum(skipped_tiles(segments, ring, tile))
  assert sum(skipped_tiles(segments, ring, tile)) > 0
  assert calls == {"forward": expected, "backward": expected}, (calls, expected)
  _assert_documents_attention(segments, (q, k, v, do), (out, *grads))


def _counted_xla_tiles():
  """XLA's tile kernels counting their calls as they run: (the counts, the kernels)."""
  calls = {"forward": 0, "backward": 0}

  def counted(name, kernel):
    def call(*args, **kwargs):
      jax.debug.callback(lambda: calls.__setitem__(name, calls[name] + 1))
      return kernel(*args, **kwargs)
    return call

  return calls, XLA_TILES._replace(forward=counted("forward", XLA_TILES.forward),
                                   backward=counted("backward", XLA_TILES.backward))


def _assert_documents_attention(segments_BS, inputs, got):
  """`got` (out, dq, dk, dv) is float32 causal attention within the documents, `jax.nn.dot_product_attention`'s."""
  q, k, v, do = inputs
  mask = jnp.asarray(segments_BS[:, None, :, None] == segments_BS[:, None, None, :])
  ref, ref_vjp = jax.vjp(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask, scale=8 ** -0.5,
                                                                     is_causal=True), q, k, v)
  for name, g, r in zip(("out", "dq", "dk", "dv"), got, (ref, *ref_vjp(do))):
    assert_close(g, r, RTOL, name)


# Row 0: boundaries at tile edges (8, 16) and inside tiles (21, 40); row 1: 24 documents, over cuDNN's packed bound.
ONE_DEVICE_SEGMENTS = np.stack([np.searchsorted([8, 16, 21, 40], np.arange(48), side="right"),
                                np.arange(48) // 2]).astype(np.int32)


@pytest.mark.parametrize("tile, skipped", [(8, 12), (16, 2)])  # 16: a tile straddles the row's two chunks
def test_the_tile_loop_over_one_device_is_attention_within_documents(tile, skipped):
  """`tile_loop_forward` and `tile_loop_backward` (a ring of one, XLA's tiles, GQA) on whole rows of packed
  documents: outputs and the gradients of q, k and v equal the masked float32 oracle's, and each loop computes the
  causal pairs less the ones skipped (counted by hand: row 0's documents bound them, each tile's key tiles before
  its first document).

  Mutants that failed it: the diagonal pair unmasked (`diagonal_mask` → None); the off-diagonal pairs unmasked;
  the key loops starting at `first + 1`; starting at 0 (the call counts); `_held_offset` of a ring of one
  `(w + 1) * tile` and `w * tile + 1`; `_diagonal_tile` of a ring of one `t - 1`."""
  rng = np.random.default_rng(7)
  q, k, v, do = (jnp.asarray(rng.normal(size=(2, 48, h, 8)), jnp.float32) for h in (4, 2, 2, 4))
  segments = jnp.asarray(ONE_DEVICE_SEGMENTS)
  calls, kernels = _counted_xla_tiles()
  forward = jax.jit(tile_loop_forward, static_argnums=(4, 5, 6))
  out, lse = forward(q, k, v, segments, 8 ** -0.5, tile, kernels)
  grads = jax.jit(tile_loop_backward, static_argnums=(7, 8, 9))(q, k, v, segments, out, lse, do, 8 ** -0.5, tile,
                                                                kernels)
  jax.block_until_ready(grads)
  assert skipped_tiles(ONE_DEVICE_SEGMENTS, 1, tile) == [skipped]
  expected = key_tiles_per_device(48, 1, tile)[0] - skipped
  assert calls == {"forward": expected, "backward": expected}, (calls, expected)
  _assert_documents_attention(ONE_DEVICE_SEGMENTS, (q, k, v, do), (out, *grads))


def test_the_tile_loop_over_one_device_moves_nothing_between_devices():
  """Lowered inside a shard_map over an 'expert' axis of 2, where a gather over it would compile, the ring of one's
  forward and backward hold no collective and no device index; context parallelism over the same axis does gather.

  Mutants that failed it: `_gather` and `_scatter_home` ignoring a ring of one; `_diagonal_tile` reading
  `axis_index` before its ring-of-one return."""
  mesh = _mesh(1, 2)
  q, k, v = (jnp.zeros((1, 16, h, 8), jnp.float32) for h in (4, 2, 2))
  segments = jnp.zeros((1, 16), jnp.int32)

  def both(q, k, v, segments):
    out, lse = tile_loop_forward(q, k, v, segments, 1.0, 4, XLA_TILES)
    return tile_loop_backward(q, k, v, segments, out, lse, out, 1.0, 4, XLA_TILES)

  one = jax.shard_map(both, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)
  text = jax.jit(one).lower(q, k, v, segments).as_text()
  for op in ("all_gather", "reduce_scatter", "all_reduce", "collective_permute", "partition_id", "replica_id"):
    assert op not in text, op
  ring = functools.partial(context_attention, mesh=mesh, scale=1.0, tile=4, segment_ids_BS=segments)
  assert "all_gather" in jax.jit(ring).lower(q, k, v).as_text()
