"""Packed documents: a document's logits, loss and gradients do not depend on what precedes it in the window, on
every attention path; segment ids from EOS; the held-out loss.

Float32 on emulated CPU devices. Tolerance 1e-6 relative (max |a − b| / max |b| per array): the same document at
another place in the window differs only by summation order (observed ≤ 4e-7).
"""

import dataclasses
import json
import os
import shutil
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import assert_close, requires_devices
from models.qwen3 import model as qwen3
from models.attention.causal import attention
from models.attention.cudnn import CUDNN_TILES, tile_kernels
from models.attention import cudnn_documents
from models.attention.cudnn_documents import documents_attention, documents_attention_on, packed_bound, rows_per_call
from models.attention.documents import packed_layout
from models.attention.context_parallel import XLA_TILES, balanced_order, context_attention, skipped_tiles
from models.qwen3.config import load_config
from models.runtime import RuntimeConfig
from train.config import DataConfig, EvalConfig, MeshConfig, RunConfig
from train import loop
from train.data.batches import DataChanged, TokenWindows, documents, make_sources, next_token_inputs
from train.loop import run
from train.mesh import build_mesh

RTOL = 1e-6
S, L = 64, 21  # window, and the document followed in it
CONFIG = load_config("tiny", num_hidden_layers=1)


def _packed_rows():
  """Rows of S tokens that hold the same document of L tokens (positions 0, 30 and S − L) among others, and their
  segment ids; row 3 is many short documents."""
  rng = np.random.default_rng(0)
  tokens, segments = rng.integers(0, CONFIG.vocab_size, (4, S)), np.zeros((4, S), np.int32)
  document = rng.integers(0, CONFIG.vocab_size, L)
  for row, start, boundaries in ((0, 0, (L, 40)), (1, 30, (5, 30, 30 + L)), (2, S - L, (10, S - L))):
    tokens[row, start:start + L] = document
    for b in boundaries:
      segments[row, b:] += 1
  segments[3] = np.arange(S) // 7
  return jnp.asarray(tokens, jnp.int32), jnp.asarray(segments), (0, 30, S - L)


def _document_results(dispatcher, expert, context_parallel):
  """Per row holding the document: its logits, its mean loss and that loss's gradients."""
  mesh = build_mesh(MeshConfig(data=1, expert=expert), jax.devices()[:expert])
  runtime = RuntimeConfig(dtype="float32", loss_chunk_tokens=8, dispatcher=dispatcher,
                          context_parallel=context_parallel)
  graphdef, state = nnx.split(qwen3.create_sharded(CONFIG, mesh, seed=0, runtime=runtime))
  tokens, segments, starts = _packed_rows()
  labels = jnp.roll(tokens, -1, axis=1)

  def loss(params, weights):
    return nnx.merge(graphdef, params).mean_cross_entropy_and_aux(tokens, labels, segments, weights_BS=weights)[0]

  logits = jax.jit(lambda p: nnx.merge(graphdef, p)(tokens, segments))(state)
  loss_and_grads = jax.jit(jax.value_and_grad(loss))
  results = []
  for row, start in enumerate(starts):
    weights = np.zeros((4, S), np.float32)
    weights[row, start:start + L - 1] = 1  # the document's targets inside it
    value, grads = loss_and_grads(state, jnp.asarray(weights))
    results.append((logits[row, start:start + L], value, nnx.to_pure_dict(grads)))
  return results


def _assert_placement_free(results):
  """Every placement of the document equals the first (at position 0: the document alone, attention being causal)."""
  alone = results[0]
  for placed in results[1:]:
    assert_close(placed[0], alone[0], RTOL, "logits")
    assert_close(placed[1], alone[1], RTOL, "loss")
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(placed[2]), jax.tree.leaves(alone[2])):
      assert_close(g, r, 10 * RTOL, jax.tree_util.keystr(path))  # sums over the other tokens' zero gradients


GRID = [(d, e, cp) for d in ("ring_expert", "ring_token", "all_to_all", "dense", "auto")
        for e, cp in ((4, False), (2, True), (4, True))]
# Each case compiles the model twice (~8-13 s on 2 cores): CI's second step runs one per dispatcher, both attention
# paths (the tile loop over 2 and 4 devices, XLA's mask); `pytest -m full_grid` the rest. The default run keeps the
# attention-level checks below.
SLOW_CASES = [("ring_expert", 4, True), ("ring_token", 2, True), ("all_to_all", 4, False), ("dense", 2, True),
              ("auto", 4, False)]


@pytest.mark.parametrize("dispatcher, expert, context_parallel",
                         [pytest.param(*c, marks=pytest.mark.slow if c in SLOW_CASES else pytest.mark.full_grid)
                          for c in GRID])
def test_a_document_computes_the_same_wherever_it_lies_in_the_window(dispatcher, expert, context_parallel):
  requires_devices(expert)
  _assert_placement_free(_document_results(dispatcher, expert, context_parallel))


@pytest.mark.slow  # compiles the model twice (~13 s on 2 cores)
def test_one_segment_and_unit_weights_reproduce_the_unmasked_model_exactly():
  """Masking off is today's computation; one document over the whole row is the same numbers, bit for bit (the
  loss's forward; its gradient is computed in the same pass)."""
  mesh = build_mesh(MeshConfig(data=1, expert=4), jax.devices()[:4])
  runtime = RuntimeConfig(dtype="float32", loss_chunk_tokens=8)
  graphdef, state = nnx.split(qwen3.create_sharded(CONFIG, mesh, seed=0, runtime=runtime))
  tokens = _packed_rows()[0]

  @jax.jit
  def losses(params):
    model = nnx.merge(graphdef, params)
    labels = jnp.roll(tokens, -1, 1)
    ones = jnp.ones(tokens.shape, jnp.int32)
    return (model.mean_cross_entropy_and_aux(tokens, labels)[0],
            model.mean_cross_entropy_and_aux(tokens, labels, 0 * ones, weights_BS=ones)[0])

  plain, masked = losses(state)
  assert float(plain) == float(masked)


def test_segments_and_positions_restart_after_each_eos():
  batch = documents(np.array([[5, 9, 0, 7, 0, 0, 3]]), eos=0)
  np.testing.assert_array_equal(batch["segment_ids"], [[0, 0, 0, 1, 1, 2, 3]])
  np.testing.assert_array_equal(batch["positions"], [[0, 1, 2, 0, 1, 0, 0]])
  assert set(documents(np.zeros((1, 3), np.int32), eos=None)) == {"tokens"}


def test_the_target_after_each_eos_leaves_the_loss():
  """`next_token_inputs`' weights: 0 exactly where the input is an EOS (its target starts the next document)."""
  tokens = np.array([[5, 9, 0, 7, 0, 0, 3, 4], [1, 2, 3, 4, 5, 6, 7, 0]])
  inputs, labels, kwargs = next_token_inputs(documents(tokens, eos=0))
  np.testing.assert_array_equal(labels, tokens[:, 1:])
  np.testing.assert_array_equal(kwargs["weights_BS"], tokens[:, :-1] != 0)
  np.testing.assert_array_equal(kwargs["segment_ids_BS"], [[0, 0, 0, 1, 1, 2, 3], [0] * 7])
  assert set(next_token_inputs(documents(tokens, eos=None))[2]) == set()


def test_xla_attention_keeps_each_query_in_its_document():
  """`models.attention.causal.attention` (XLA) of a packed row: each document's output is that of the document
  alone, the first document's and the last's, where every earlier key would otherwise be seen."""
  rng = np.random.default_rng(4)
  q, k, v = (jnp.asarray(rng.normal(size=(1, 12, h, 8)), jnp.float32) for h in (4, 2, 2))
  segments = jnp.asarray([[0] * 5 + [1] * 3 + [2] * 4], jnp.int32)
  packed = attention(q, k, v, 8 ** -0.5, "xla", "cpu", segment_ids_BS=segments)
  for start, stop in ((0, 5), (5, 8), (8, 12)):
    alone = attention(q[:, start:stop], k[:, start:stop], v[:, start:stop], 8 ** -0.5, "xla", "cpu")
    assert_close(packed[:, start:stop], alone, 1e-6, f"document [{start}, {stop})")


def test_packed_layout_lists_each_rows_documents_and_whether_they_fit():
  segments = jnp.asarray([[3, 3, 3, 4, 4, 7, 8, 8], [0, 0, 0, 0, 0, 0, 0, 0], [1, 2, 3, 4, 5, 6, 7, 8]])
  lengths, offsets, fits = packed_layout(segments, 4)
  np.testing.assert_array_equal(lengths[:2], [[3, 2, 1, 2], [8, -1, -1, -1]])
  np.testing.assert_array_equal(offsets[:2], [[0, 3, 5, 6, -1], [0, -1, -1, -1, -1]])
  assert not fits  # row 2: eight documents
  assert packed_layout(segments[:2], 4)[2] and not packed_layout(segments[:2], 3)[2]


def test_packed_calls_hold_as_many_rows_as_their_temporaries_allow():
  """cuDNN's packed backward takes 2·M·S·Q·Z float32 bytes a row: 2 GiB a row of the 30B shape's 4096 tokens."""
  def rows(batch, tokens, heads=32, m=16, budget=2 << 30):
    return rows_per_call(jax.ShapeDtypeStruct((batch, tokens, heads, 128), jnp.bfloat16), m, budget)

  assert rows(16, 4096) == 1 and rows(16, 4096, budget=8 << 30) == 4 and rows(16, 4096, m=8, budget=4 << 30) == 4
  assert rows(16, 1024) == 4 and rows(16, 256) == 16 and rows(16, 65536) == 1
  assert rows(12, 1024, budget=5 << 29) == 4  # a divisor of the rows, not the most that fit (5)


def test_the_runtime_sets_the_packed_bound(monkeypatch):
  """`runtime.documents_per_row` reaches cuDNN's packed calls (stubbed: no GPU here); under 2 it is refused."""
  seen = []
  monkeypatch.setattr(cudnn_documents, "unavailable", lambda *_: None)
  monkeypatch.setattr(cudnn_documents, "documents_attention_on", lambda q, *args: seen.append(args[-1]) or q)
  mesh = build_mesh(MeshConfig(data=1, expert=1), jax.devices()[:1])
  q = jnp.zeros((1, 8, 2, 4), jnp.bfloat16)
  runtime = RuntimeConfig(attention_implementation="cudnn", documents_per_row=32)
  qwen3.attend_heads(q, q, q, 0.5, runtime, mesh, jnp.zeros((1, 8), jnp.int32))
  assert seen == [32]
  with pytest.raises(ValueError, match="documents_per_row=1 must be an integer ≥ 2"):
    RuntimeConfig(documents_per_row=1)


def _windows_of_3_5_and_1_documents(tmp_path):
  """A token file of three windows of 16 inputs (EOS 0): 3, 5 and 1 documents in their inputs (an EOS at a window's
  last input starts the next document after it: not in the window)."""
  tokens = np.ones(3 * 16 + 1, np.uint16)
  tokens[[3, 9]] = 0
  tokens[[16 + 1, 16 + 4, 16 + 7, 16 + 10, 16 + 15]] = 0
  tokens.tofile(tmp_path / "t.bin")
  return DataConfig(kind="tokens", path=str(tmp_path / "t.bin"), eos_token=0)


def test_the_data_sets_the_packed_bound_within_a_rows_temporaries(tmp_path, monkeypatch, capsys):
  """`documents_per_row: auto` (the default): the trainer takes the most documents a row of the run's windows holds
  (`most_documents`, read before the step is planned), at least 2, at most what one row's packed backward may take
  (`packed_bound`); an explicit bound, unmasked documents and data without documents keep theirs.

  Mutants that failed it: the window's last input counted; the windows not bounded by `windows`; the budget cap
  dropped; `resolve_documents` not called before `resolve_step`."""
  data = _windows_of_3_5_and_1_documents(tmp_path)
  source = make_sources(data, EvalConfig(), 16, 16)[0]
  assert source.most_documents(16) == 5 and source.most_documents(16, windows=1) == 3
  assert source.most_documents(16, scan=32) == 5 and source.most_documents(16, scan=16) == 3
  assert TokenWindows(np.ones(33, np.int32), 16).most_documents(16) is None  # no EOS id: no documents
  assert packed_bound(5, 4096, 32, 128) == 5 and packed_bound(1, 4096, 32, 128) == 2
  assert packed_bound(40, 4096, 32, 128) == 16 and packed_bound(80, 4096, 8, 128) == 64  # 2 GiB a row
  assert packed_bound(28, 32768, 32, 128) == 2

  class Planned(Exception):
    pass

  def resolve_step(resolved, resume):
    raise Planned(resolved.run_config.runtime.documents_per_row)

  monkeypatch.setattr(loop, "resolve_step", resolve_step)
  base = RunConfig(model="tiny", mesh=MeshConfig(data=1, expert=-1), batch_size=1, seq_len=16, steps=3,
                   out_dir=str(tmp_path / "run"), tensorboard=False, data=data)
  for config, planned in ((base, 5), (dataclasses.replace(base, steps=1), 3),
                          (dataclasses.replace(base, runtime=RuntimeConfig(documents_per_row=8)), 8),
                          (dataclasses.replace(base, data=dataclasses.replace(data, document_masking=False)), "auto"),
                          (dataclasses.replace(base, data=DataConfig()), "auto")):
    with pytest.raises(Planned) as seen:
      run(config, overwrite=True)
    assert seen.value.args == (planned,)
  assert "documents: at most 5 in a row of data.path" in capsys.readouterr().out
  with pytest.raises(ValueError, match="documents_per_row='some' must be an integer ≥ 2 .* or 'auto'"):
    RuntimeConfig(documents_per_row="some")


def test_a_call_over_the_packed_bound_takes_the_tile_loop(monkeypatch):
  """`documents_attention` with every row over its bound (M = 2), a row a call: the tile loop (XLA's tiles standing in
  for cuDNN's; the packed kernels stubbed with zeros, the branch not taken) equals the masked float32 oracle in
  values and gradients, through the custom VJP's statistics [rows·M, Q, S].

  Mutants that failed it: the tile loop's logsumexp read from the padding (`stats[-rows:]`); the branches swapped."""
  b, s = 2, 64
  zeros = lambda q, *_, **__: (jnp.zeros_like(q), jnp.zeros((q.shape[0] * 2, q.shape[2], s), jnp.float32))
  bind = lambda q, k, v, *_, **__: (jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v))
  monkeypatch.setattr(cudnn_documents, "CUDNN_TILES", XLA_TILES)
  monkeypatch.setattr(cudnn_documents, "jax_cudnn", types.SimpleNamespace(
      dot_product_attention=zeros, _dot_product_attention_bwd_p_wrapper=types.SimpleNamespace(bind=bind),
      MaskType=cudnn_documents.jax_cudnn.MaskType, AttentionLayout=cudnn_documents.jax_cudnn.AttentionLayout))
  rng = np.random.default_rng(2)
  q, k, v, do = (jnp.asarray(rng.normal(size=(b, s, h, 8)), jnp.float32) for h in (4, 2, 2, 4))
  segments = np.stack([np.arange(s) // 5, np.searchsorted([20, 32, 50], np.arange(s), side="right")])
  assert not any(packed_layout(jnp.asarray(row[None]), 2)[2] for row in segments)
  f = lambda q, k, v: documents_attention(q, k, v, jnp.asarray(segments, jnp.int32), 8 ** -0.5, 2, 1)
  out, vjp = jax.vjp(jax.jit(f), q, k, v)
  mask = jnp.asarray(segments[:, None, :, None] == segments[:, None, None, :])
  ref, ref_vjp = jax.vjp(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask, scale=8 ** -0.5,
                                                                     is_causal=True), q, k, v)
  for name, g, r in zip(("out", "dq", "dk", "dv"), (out, *vjp(do)), (ref, *ref_vjp(do))):
    assert_close(g, r, 1e-5, name)
  # Tiles: at most half the row and 2048 rows, a divisor of it; a row with no divisor near that is one tile.
  assert [cudnn_documents.long_row_tile(n) for n in (64, 2048, 6144, 32768, 4099)] == [32, 1024, 2048, 2048, 4099]


def test_context_parallel_tiles_skip_what_a_document_cannot_see():
  """Tile by tile over 4 devices (tiles of 4 rows): equal to the masked whole-row attention, values and grads."""
  requires_devices(4)
  mesh = build_mesh(MeshConfig(data=1, expert=4), jax.devices()[:4])
  rng = np.random.default_rng(1)
  q, k, v, do = (jnp.asarray(rng.normal(size=(2, S, h, 8)), jnp.float32) for h in (4, 2, 2, 4))
  segments = jnp.asarray(np.cumsum(rng.random((2, S)) < 0.1, axis=1), jnp.int32)
  order = balanced_order(S, 4)

  def sharded(q, k, v):
    return context_attention(q[:, order], k[:, order], v[:, order], mesh=mesh, scale=8 ** -0.5, kernels=XLA_TILES,
                             tile=4, segment_ids_BS=segments[:, order])[:, np.argsort(order)]

  def whole(q, k, v):
    mask = segments[:, None, :, None] == segments[:, None, None, :]
    return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=8 ** -0.5, is_causal=True)

  for f in (sharded, whole):
    out, vjp = jax.vjp(jax.jit(f), q, k, v)
    if f is sharded:
      got = (out, *vjp(do))
    else:
      for name, g, r in zip(("out", "dq", "dk", "dv"), got, (out, *vjp(do))):
        assert_close(g, r, 1e-5, name)


def test_eval_fraction_splits_whole_documents_off_the_training_data(tmp_path):
  stream = np.array([1, 2, 0, 3, 4, 5, 0, 6, 7, 0, 8, 9, 10, 11, 0], np.uint16)
  (tmp_path / "t.bin").write_bytes(stream.tobytes())
  data = DataConfig(kind="tokens", path=str(tmp_path / "t.bin"), eos_token=0)
  train, held_out = make_sources(data, EvalConfig(fraction=0.4, every=1), vocab_size=16, seq_len=2)
  np.testing.assert_array_equal(train.tokens, stream[:10])  # the cut (token 9) moved to the document's end
  np.testing.assert_array_equal(held_out.tokens, stream[10:])
  np.testing.assert_array_equal(held_out.batch(0, 1, 2)[0], stream[10:13])  # read from the file, at the cut
  np.testing.assert_array_equal(train.batch(1, 1, 2)[0], stream[2:5])
  os.truncate(tmp_path / "t.bin", 2 * 4)  # both parts still notice the file shrinking under the run
  np.testing.assert_array_equal(train.batch(0, 1, 2)[0], stream[0:3])
  with pytest.raises(DataChanged, match=r"^step 0: eval.fraction=0.4 of data.path .* shrank under the run"):
    held_out.batch(0, 1, 2)
  with pytest.raises(DataChanged, match=r"^step 2: data.path .* less eval.fraction shrank under the run"):
    train.batch(2, 1, 2)
  assert data.masks_documents() and not DataConfig().masks_documents()
  with pytest.raises(ValueError, match="document_masking=true needs documents"):
    DataConfig(kind="text", path="x.txt", document_masking=True)


@pytest.mark.slow  # three trainer runs (~15 s each on 2 cores)
def test_eval_losses_repeat_across_reruns_and_resume(tmp_path):
  base = RunConfig(model="tiny", runtime=RuntimeConfig(dtype="float32"), mesh=MeshConfig(data=2, expert=4),
                   batch_size=8, seq_len=16, steps=6, log_every=1, checkpoint_every=3, tensorboard=False,
                   eval=EvalConfig(every=2, batches=2))

  def eval_records(name, resume=False):
    config = dataclasses.replace(base, out_dir=str(tmp_path / name))
    if resume:
      shutil.rmtree(tmp_path / name / "checkpoints" / "6")
      run(config, resume=True)
    else:
      run(config, overwrite=True)
    lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["eval_loss"], r["eval_tokens"]) for r in map(json.loads, lines) if "eval_loss" in r]

  first = eval_records("a")
  assert [s for s, _, _ in first] == [1, 3, 5] and all(t == 2 * 8 * 16 for _, _, t in first)
  assert first == eval_records("b")
  assert eval_records("b", resume=True) == first


@pytest.mark.gpu
def test_cudnn_attends_within_documents():
  """On a GPU, bfloat16 (within 2e-2 relative: 8 bits kept): cuDNN's whole-sequence attention (the model's path:
  each document a sequence of cuDNN's packed layout, all rows at once, row by row or each device's rows of a mesh;
  and, for a call holding a row of more documents than its bound, the tile loop over one device, the other calls
  still packed: tiles of 1024 rows, all masked in the call of both rows, row 0's second tile skipping its first
  alone) and its context-parallel tiles (one device holds both chunks; tiles of 256 rows) with documents, values and
  gradients, against XLA's masked attention in float32; and a document's logits in the model on cuDNN wherever it
  lies."""
  if jax.default_backend() != "gpu" or tile_kernels("auto", "gpu", jnp.bfloat16) is not CUDNN_TILES:
    pytest.skip("cuDNN attends on a GPU with cuDNN; run `pytest -m gpu` there")
  mesh = build_mesh(MeshConfig(data=1, expert=1), jax.devices()[:1])
  rng = np.random.default_rng(5)
  q, k, v, do = (jnp.asarray(rng.normal(size=(2, 2048, h, 128)), jnp.bfloat16) for h in (8, 2, 2, 8))
  # Row 0: documents of about 300 tokens (6), one starting at the tile loop's second tile; row 1: two documents.
  segments = jnp.asarray(np.stack([np.cumsum(rng.random(2048) < 1 / 300) + (np.arange(2048) >= 1024),
                                   np.arange(2048) >= 700]), jnp.int32)
  scale = 128 ** -0.5
  paths = dict(
      cudnn=lambda q, k, v: attention(q, k, v, scale, "cudnn", "gpu", segments),
      cudnn_more_documents_than_packed=lambda q, k, v: documents_attention(q, k, v, segments, scale, 2),
      cudnn_packed_row_by_row=lambda q, k, v: documents_attention(q, k, v, segments, scale, 16, 1),
      cudnn_one_call_tiled_one_packed=lambda q, k, v: documents_attention(q, k, v, segments, scale, 2, 1),
      cudnn_packed_on_mesh=lambda q, k, v: documents_attention_on(q, k, v, segments, scale, mesh, ("data", "expert")),
      cudnn_tiles=lambda q, k, v: context_attention(q, k, v, mesh=mesh, scale=scale, kernels=CUDNN_TILES, tile=256,
                                                    segment_ids_BS=segments))
  assert packed_layout(segments, 16)[2] and not packed_layout(segments[:1], 2)[2] and packed_layout(segments[1:], 2)[2]
  assert cudnn_documents.unavailable("gpu", q, k) is None  # so "cudnn" below is the packed layout
  assert cudnn_documents.long_row_tile(2048) == 1024 and skipped_tiles(segments[:1], 1, 1024) == [1]
  as_f32 = [a.astype(jnp.float32) for a in (q, k, v, do)]
  ref_out, ref_vjp = jax.vjp(jax.jit(lambda q, k, v: attention(q, k, v, scale, "xla", "gpu", segments)), *as_f32[:3])
  for name, f in paths.items():
    out, vjp = jax.vjp(jax.jit(f), q, k, v)
    for part, g, r in zip(("out", "dq", "dk", "dv"), (out, *vjp(do)), (ref_out, *ref_vjp(as_f32[3]))):
      assert_close(g.astype(jnp.float32), r, 2e-2, f"{name} {part}")
  runtime = RuntimeConfig(dtype="bfloat16", attention_implementation="cudnn", loss_chunk_tokens=8)
  graphdef, state = nnx.split(qwen3.create_sharded(CONFIG, mesh, seed=0, runtime=runtime))
  tokens, segments, starts = _packed_rows()
  logits = jax.jit(lambda p: nnx.merge(graphdef, p)(tokens, segments))(state)
  for row, start in enumerate(starts[1:], 1):
    assert_close(logits[row, start:start + L], logits[0, :L], 2e-2, f"logits at {start}")
