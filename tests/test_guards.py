"""Nothing silently wrong around the held-out loss, the router bias, the load metrics and the profile: each input
that cannot work is one line before anything compiles, each number is the right one (issue 49)."""

import dataclasses
import json
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import profiler as jax_profiler
import pytest
from flax import nnx

from conftest import broadcast_constants, requires_devices, tensorboard_scalars
from models.inputs import embed
from models.qwen3 import model as qwen3
from models.qwen3.config import load_config
from models.qwen35.config import load_config as load_qwen35_config
from models.router_state import non_finite_biases
from models.runtime import RuntimeConfig
from relaymoe_jax.errors import UserError
from test_evaluate import _setup as evaluate_setup
from test_train import tiny_run
from train.config import DataConfig, EvalConfig, MeshConfig
from train.data.batches import DataChanged, make_sources
from train.evaluate import Evaluator
from train.loop import _say_if_data_changed, run
from train.mesh import build_mesh
from train.metrics import MetricsLog
from train.profile import window as window_module
from train.profile.window import StepProfiler, Window, check_window
from train.step import BAD_BIAS, non_finite_state


def test_tensorboard_worst_layer_is_the_worst_layer_not_a_sum(tmp_path):
  log = MetricsLog(tmp_path, total_steps=4, start_step=0, tensorboard=True, moe_layers=[0, 1, 2])
  log.write(dict(step=1, dead_experts=[2, 5, 1], dropped_pairs=[0, 7, 3], expert_load_cv=[0.1, 0.4, 0.2]))
  log.close()
  scalars = tensorboard_scalars(tmp_path / "tensorboard")
  assert scalars[(1, "moe/dead_experts_worst_layer")] == 5
  assert scalars[(1, "moe/dropped_pairs_worst_layer")] == 7
  assert scalars[(1, "moe/expert_load_cv_worst_layer")] == pytest.approx(0.4)


@pytest.mark.parametrize("rate", [math.inf, math.nan, -0.1])
@pytest.mark.parametrize("load", [load_config, load_qwen35_config], ids=["qwen3", "qwen35"])
def test_a_router_bias_rate_that_is_not_finite_is_named(load, rate):
  with pytest.raises(UserError, match=f"^router_bias_update_rate={rate} must be finite and ≥ 0"):
    load("tiny" if load is load_config else "qwen3.5-tiny", router_bias_update_rate=rate)


def test_a_non_finite_router_bias_or_load_statistic_is_non_finite_state():
  finite = dict(loss=2.0, grad_norm=1.0, update_norm=0.1, expert_load_cv=[0.1, 0.2], dead_experts=[0, 1])
  assert non_finite_state(dict(finite, **{BAD_BIAS: 0})) == ""
  assert "3 router-bias entries not finite" in non_finite_state(dict(finite, **{BAD_BIAS: 3}))
  assert "expert_load_cv [0.1, nan]" in non_finite_state(dict(finite, expert_load_cv=[0.1, math.nan]))
  assert non_finite_state(dict(finite, loss=math.nan)).startswith("loss nan, gradient norm 1.0")


def test_router_bias_entries_that_are_not_finite_are_counted():
  """The count the loop stops on (`BAD_BIAS`): every router bias's entries, no other parameter's; the model's
  biases are where it looks."""
  requires_devices(8)
  params = {"layers": {0: {"mlp": {"router_bias_E": np.array([0.0, np.inf, np.nan])}},
                       1: {"mlp": {"router_bias_E": np.array([[np.nan, 1.0]])}}}, "w": np.array([np.nan])}
  assert int(non_finite_biases(params)) == 3
  config = load_config("tiny", router_bias_update_rate=0.01)
  state = qwen3.abstract(config, build_mesh(MeshConfig(data=2, expert=4)), runtime=RuntimeConfig())[1]
  zeros = jax.tree.map(lambda leaf: np.full(leaf.shape, np.nan, np.float32), nnx.to_pure_dict(state))
  assert int(non_finite_biases(zeros)) == config.num_experts * config.num_hidden_layers


@pytest.mark.slow  # trains two steps of its own (a compile, ~15 s on 2 cores); CI's second step runs it
def test_a_router_bias_that_overflows_stops_the_run_before_it_is_saved(tmp_path):
  requires_devices(8)
  config = tiny_run(tmp_path, steps=3, checkpoint_every=1, model_overrides=dict(router_bias_update_rate=3e38))
  with pytest.raises(FloatingPointError, match=r"non-finite training state at step 1: .*router-bias entries not "
                                               r"finite; stopping. The last good checkpoint is step 1"):
    run(config)


def test_a_uint32_eval_file_beside_uint16_training_data_is_named_and_read_with_eval_token_dtype(tmp_path):
  """Read as uint16, its ids' high halves were 0s: with eos 0, half the targets left the loss as cross-document."""
  rng = np.random.default_rng(0)
  rng.integers(1, 96, 4096).astype(np.uint16).tofile(tmp_path / "train.bin")
  held_out = rng.integers(1, 96, 2048).astype(np.uint32)
  held_out.tofile(tmp_path / "eval.bin")
  data = DataConfig(kind="tokens", path=str(tmp_path / "train.bin"), eos_token=0)
  with pytest.raises(UserError, match=rf"^eval.path '{tmp_path}/eval.bin' reads as uint32 ids: every second of its "
                                      r"first 4096 uint16 tokens is 0; set eval.token_dtype=uint32$"):
    make_sources(data, EvalConfig(path=str(tmp_path / "eval.bin")), 96, 16)
  train, source = make_sources(data, EvalConfig(path=str(tmp_path / "eval.bin"), token_dtype="uint32"), 96, 16)
  assert train.tokens.dtype == np.uint16 and np.array_equal(source.tokens, held_out)
  with pytest.raises(UserError, match=r"^data.path '.*eval.bin' reads as uint32 ids: .* set data.token_dtype=uint32"):
    make_sources(dataclasses.replace(data, path=str(tmp_path / "eval.bin")), EvalConfig(), 96, 16)
  with pytest.raises(UserError, match=r"^eval.token_dtype='int8' must be uint16 or uint32"):
    EvalConfig(token_dtype="int8")


def test_training_data_of_only_eos_is_refused(tmp_path):
  """Every target follows an EOS and leaves the loss: it trained at ce 0.0."""
  np.zeros(1000, np.uint16).tofile(tmp_path / "eos.bin")
  data = DataConfig(kind="tokens", path=str(tmp_path / "eos.bin"), eos_token=0)
  with pytest.raises(UserError, match=rf"^data.path '{tmp_path}/eos.bin' holds only the EOS id 0 \(data.eos_token\): "
                                      "no target is in its input's document"):
    make_sources(data, EvalConfig(), 96, 16)
  make_sources(dataclasses.replace(data, document_masking=False), EvalConfig(), 96, 16)  # every target counts


def test_resuming_with_a_larger_eval_fraction_says_it_evaluates_on_trained_data(tmp_path, capsys):
  stored = tmp_path / "run_config.json"
  stored.write_text(json.dumps(dict(run=dict(eval=dict(fraction=0.0, path="")), data_file=None)))
  _say_if_data_changed(stored, None, EvalConfig(fraction=0.1, every=5))
  assert capsys.readouterr().out == (
      "warning: eval.fraction=0.1 holds out data that the steps before this resume trained on (they ran with "
      "eval.fraction=0.0): the held-out loss is partly over data the model has seen, and the training batches from "
      "here on are cut from less data\n")
  for before, now in [(0.1, 0.1), (0.2, 0.1), (0.1, 0.0)]:  # held out all along: nothing to say
    stored.write_text(json.dumps(dict(run=dict(eval=dict(fraction=before)))))
    _say_if_data_changed(stored, None, EvalConfig(fraction=now))
    assert capsys.readouterr().out == ""


def _tiny_model():
  """test_evaluate's one-layer model (float32, dense) and its jitted logits(state, tokens [8, 32], segment ids):
  compiled once for both files."""
  _, graphdef, state, _, logits = evaluate_setup()
  return nnx.merge(graphdef, state), lambda tokens, segments: logits(state, tokens, segments)


def test_a_segment_id_that_comes_back_is_another_document():
  """[0…, 1…, 0…]: the third span attended to the first; a change of id starts a document."""
  _, logits = _tiny_model()
  tokens = np.tile(np.arange(1, 33, dtype=np.int32), (8, 1))
  back = np.repeat(np.array([0, 1, 0, 0], np.int32), 8)[None].repeat(8, 0)
  apart = np.repeat(np.array([0, 1, 2, 2], np.int32), 8)[None].repeat(8, 0)
  np.testing.assert_array_equal(np.asarray(logits(tokens, back)), np.asarray(logits(tokens, apart)))


def test_token_ids_outside_the_vocabulary_are_named_or_nan():
  """They gave finite logits (indexing clamps): eagerly a UserError naming the first; traced, NaN."""
  model, logits = _tiny_model()
  tokens = np.ones((8, 32), np.int32)
  vocab = model.config.vocab_size
  for bad in (vocab, 500, -1):
    tokens[2, 5] = bad
    with pytest.raises(UserError, match=rf"^tokens_BS\[2, 5\] = {bad} is not a token id in \[0, {vocab}\)$"):
      model(tokens)
    out = np.asarray(logits(tokens, None))
    assert np.isnan(out[2, 5:]).all() and np.isfinite(np.delete(out, 2, axis=0)).all()  # its row's after it


def test_the_embeddings_gradient_needs_no_buffer_of_zeros():
  """`embed`'s gradient reaches the table through its gather alone: no [B, S, D] buffer of zeros for a select to
  pick from (XLA made it with the loss head's, in the forward pass, and kept it to the step's end); an id outside
  the vocabulary still embeds as NaN."""
  table = jnp.asarray(np.random.default_rng(0).normal(size=(16, 8)), jnp.bfloat16)
  tokens = jnp.asarray([[1, 3, 16, -1]], jnp.int32)
  assert embed(table, tokens).dtype == jnp.bfloat16
  out = np.asarray(embed(table, tokens), np.float32)
  np.testing.assert_array_equal(out[0, :2], np.asarray(table[jnp.asarray([1, 3])], np.float32))
  assert np.isnan(out[0, 2:]).all()
  gradient = lambda table, d_out: jax.vjp(lambda table: embed(table, tokens), table)[1](d_out)
  jaxpr = jax.make_jaxpr(gradient)(table, jnp.ones((1, 4, 8), table.dtype))
  zeros = broadcast_constants(jaxpr.jaxpr, lambda shape: shape == (1, 4, 8))
  assert not zeros, zeros


@pytest.mark.parametrize("segments,positions,message", [
    ((8, 15), None, r"^segment_ids_BS has shape \(8, 15\) and tokens_BS \(8, 16\): one per token"),
    (None, (16,), r"^positions_BS has shape \(16,\) and tokens_BS \(8, 16\): one per token"),
    (None, (8, 16, 1), r"^positions_BS has shape \(8, 16, 1\)"),
])
def test_segment_ids_or_positions_of_the_wrong_shape_are_named(segments, positions, message):
  """They failed deep in RoPE with a TypeError or IndexError naming neither."""
  model, _ = _tiny_model()
  tokens = np.ones((8, 16), np.int32)
  segments = None if segments is None else np.zeros(segments, np.int32)
  positions = None if positions is None else np.zeros(positions, np.int32)
  with pytest.raises(UserError, match=message):
    nnx.jit(lambda m, t, s, p: m(t, s, p))(model, tokens, segments, positions)
  with pytest.raises(UserError, match=r"^tokens_BS has shape \(16,\); the model takes \[batch, sequence\]"):
    model(tokens[0])
  with pytest.raises(UserError, match=r"^positions_BS is float32; it must be integers"):
    model(tokens, None, np.zeros((8, 16), np.float32))
  with pytest.raises(UserError, match=r"^tokens_BS has 2 rows, which do not split over the mesh's 8 shards of rows "
                                      r"\(data=2 × expert=4\): give a multiple of 8$"):  # JAX's IndivisibleError
    model(tokens[:2])


def test_a_profile_directory_that_cannot_be_made_is_named_before_anything_compiles(tmp_path):
  (tmp_path / "profile").write_text("a file")
  with pytest.raises(UserError, match=rf"^--profile writes its trace to {tmp_path}/profile/x, and {tmp_path}/profile "
                                      "is not a directory$"):
    check_window(Window(1, 2), 0, 4, tmp_path / "profile" / "x")
  check_window(Window(1, 2), 0, 4, tmp_path / "new" / "profile")
  assert not (tmp_path / "new").exists()  # nothing made before the run trains


def test_a_trace_that_does_not_write_is_a_warning_and_the_profilers_time_is_not_the_steps(tmp_path, monkeypatch,
                                                                                          capsys):
  """JAX's FAILED_PRECONDITION at the window's end ended the run as a bug; the analysis of the trace and an
  evaluation inside the window were counted as step time."""
  state = jax.numpy.ones(4)
  (tmp_path / "file").write_text("not a directory")
  profiler = StepProfiler(Window(0, 1), tmp_path / "file", None, 1, 1.0, None)
  profiler.before_step(0, state)
  assert profiler.after_step(0, state) >= 0 and profiler.result is None
  assert "relaymoe-train: warning: the profile of steps 0-0 is not written to" in capsys.readouterr().err
  jax_profiler._profile_state.reset()  # JAX keeps the session whose export failed as running; the run ends with it
  walls = []
  monkeypatch.setattr(StepProfiler, "summarize", lambda self, wall_s: walls.append(wall_s) or time.sleep(0.3) or {})
  monkeypatch.setattr(window_module, "render", lambda result, title: title)
  profiler = StepProfiler(Window(2, 2), tmp_path / "profile", None, 1, 1.0, None)
  assert profiler.before_step(1, state) == 0 and profiler.after_step(2, state) == 0
  profiler.before_step(2, state)
  time.sleep(0.2)
  profiler.exclude(0.2)  # an evaluation inside the window
  assert profiler.after_step(3, state) >= 0.3  # what the loop takes out of the step's time
  assert 0 <= walls[0] < 0.1 and (tmp_path / "profile" / "parts.json").exists()


@pytest.mark.slow  # trains four steps of its own (a compile, ~20 s on 2 cores); CI's second step runs it
def test_the_profiles_analysis_and_an_eval_inside_its_window_are_not_step_time(tmp_path, monkeypatch):
  """The last profiled step's tokens_per_s read 195 against ~9500 (the trace's analysis counted as its time); an
  evaluation inside the window made the profile's steps longer."""
  requires_devices(8)
  summarize = StepProfiler.summarize
  walls = []

  def slow_summarize(self, wall_s):
    walls.append(wall_s)
    time.sleep(2.0)
    return summarize(self, wall_s)

  monkeypatch.setattr(StepProfiler, "summarize", slow_summarize)
  def slow_eval(self, params):
    time.sleep(2.0)
    return dict(eval_loss=1.0, eval_ppl=2.718, eval_tokens=16, eval_s=2.0)  # an Evaluator's whole record

  monkeypatch.setattr(Evaluator, "__call__", slow_eval)
  config = tiny_run(tmp_path, steps=4, checkpoint_every=0, eval=EvalConfig(every=1, batches=1))
  history = run(config, profile=Window(1, 2))
  rates = [r["tokens_per_s"] for r in history]
  assert min(rates[1:3]) > 0.2 * max(rates), rates
  assert walls[0] < 1.5, walls


def test_eval_path_that_is_the_training_data_or_a_stray_eval_token_dtype_is_refused(tmp_path):
  """What a user tries next: the training file as its own held-out data (a held-out loss over trained data), and
  eval.token_dtype where it means nothing."""
  np.arange(1, 500, dtype=np.uint16).tofile(tmp_path / "train.bin")
  data = DataConfig(kind="tokens", path=str(tmp_path / "train.bin"))
  with pytest.raises(UserError, match=r"^eval.path='.*train.bin' is data.path, which the run trains on"):
    make_sources(data, EvalConfig(path=str(tmp_path / ".." / tmp_path.name / "train.bin")), 512, 16)
  with pytest.raises(UserError, match=r"^eval.token_dtype='uint32' is eval.path's token width, and no eval.path"):
    EvalConfig(token_dtype="uint32")
  (tmp_path / "a.txt").write_text("some text " * 20)
  (tmp_path / "b.txt").write_text("other text " * 20)
  with pytest.raises(UserError, match=r"^eval.token_dtype='uint32' is for data.kind=tokens, not 'text'"):
    make_sources(DataConfig(kind="text", path=str(tmp_path / "a.txt")),
                 EvalConfig(path=str(tmp_path / "b.txt"), token_dtype="uint32"), 512, 16)


def test_a_held_out_file_that_shrinks_names_the_held_out_batch_not_a_step(tmp_path):
  """What a user meets next: the eval file cut under the run read "step 1" for held-out batch 1."""
  np.arange(1, 400, dtype=np.uint16).tofile(tmp_path / "eval.bin")
  source = make_sources(DataConfig(kind="tokens", path=str(tmp_path / "eval.bin")), EvalConfig(), 512, 16,
                        held_out=False)[0]
  source.batch_name = "held-out batch"  # as the Evaluator names its source's (test_evaluate checks it does)
  os.truncate(tmp_path / "eval.bin", 100)
  with pytest.raises(DataChanged, match=rf"^held-out batch 1: data.path '{tmp_path}/eval.bin' shrank under the run"):
    source.batch(1, 4, 16)
