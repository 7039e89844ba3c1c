"""The held-out loss (`train.evaluate.Evaluator`) against an independent oracle: optax's cross-entropy over the
model's full float32 logits of the same batches, weighted by the targets in their input's document (a target is
left out after each EOS: the oracle's weights are `inputs != eos`, not `train.data.batches`'), summed over every
batch and divided once by the counted targets; with packed documents, and under context parallelism.

A tiny one-layer model (dense dispatcher: the MoE math is tested elsewhere), float32; 1e-5 relative.
"""

import dataclasses
import functools
import json
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from conftest import requires_devices, tensorboard_scalars
from models.qwen3 import model as qwen3
from models.qwen3.config import load_config
from models.runtime import RuntimeConfig
from train.config import DataConfig, EvalConfig, MeshConfig, RunConfig
from relaymoe_jax.errors import UserError
from train.data.batches import SyntheticLanguage, TokenWindows, make_sources
from train.evaluate import Evaluator, check_held_out, eval_due, evaluate_only
from train.run import resolve_run
from train.mesh import build_mesh
from train.metrics import MetricsLog

EOS, B, S, BATCHES = 0, 8, 32, 3
CONFIG = load_config("tiny", num_hidden_layers=1)
F32 = RuntimeConfig(dtype="float32", dispatcher="dense")
RTOL = 1e-5


@functools.lru_cache(maxsize=None)
def _setup():
  requires_devices(8)
  mesh = build_mesh(MeshConfig(data=2, expert=4))
  graphdef, state = nnx.split(qwen3.create_sharded(CONFIG, mesh, seed=0, runtime=F32))
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, CONFIG.vocab_size, 4 * B * S * BATCHES).astype(np.uint16)
  tokens[rng.random(tokens.size) < 0.08] = EOS  # documents of ~12 tokens: many targets after an EOS
  logits = jax.jit(lambda p, t, s: nnx.merge(graphdef, p)(t, s))
  return mesh, graphdef, state, tokens, logits


def _run_config(documents, runtime=F32):
  data = DataConfig(kind="tokens", path="held_out.bin", eos_token=EOS) if documents else DataConfig()
  return RunConfig(model="tiny", runtime=runtime, mesh=MeshConfig(data=2, expert=4), batch_size=B, seq_len=S,
                   data=data, eval=EvalConfig(every=1, batches=BATCHES), tensorboard=False)


def _oracle(source, documents, b=B):
  """(Σ weight · optax cross-entropy / Σ weight, Σ weight) over the eval batches of `b` rows, from full logits."""
  _, _, state, _, logits = _setup()
  total, count = 0.0, 0.0
  for i in range(BATCHES):
    tokens = source.batch(i, b, S)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    if documents:
      segments = np.concatenate([np.zeros((b, 1), np.int32), np.cumsum(inputs[:, :-1] == EOS, axis=1)], axis=1)
      weights = (inputs != EOS).astype(np.float32)  # the target after an EOS starts another document
    else:
      segments, weights = None, np.ones(inputs.shape, np.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits(state, jnp.asarray(inputs), segments),
                                                         jnp.asarray(labels))
    total += float(jnp.sum(ce * weights))
    count += float(weights.sum())
  return total / count, count


def _check(values, oracle_loss, oracle_tokens):
  assert values["eval_tokens"] == int(oracle_tokens), (values["eval_tokens"], oracle_tokens)
  assert abs(values["eval_loss"] - oracle_loss) <= RTOL * oracle_loss, (values["eval_loss"], oracle_loss)
  assert abs(values["eval_ppl"] - np.exp(oracle_loss)) <= 2 * RTOL * np.exp(oracle_loss)


def test_eval_loss_is_optax_weighted_cross_entropy_over_the_counted_targets():
  mesh, graphdef, state, tokens, _ = _setup()
  source = TokenWindows(tokens, CONFIG.vocab_size, S, eos=EOS)
  loss, counted = _oracle(source, documents=True)
  assert counted < BATCHES * B * S - BATCHES * B  # the weights do leave targets out
  _check(Evaluator(_run_config(True), source, graphdef, state, mesh)(state), loss, counted)


@pytest.mark.parametrize("documents", [False, True])
def test_eval_loss_under_context_parallelism_is_the_oracles(documents):
  """The eval's forward in the held order (positions and segment ids reordered, CP's tile loop) gives the loss of
  the model without context parallelism; without documents the positions are the model's own."""
  mesh, _, state, tokens, _ = _setup()
  source = (TokenWindows(tokens, CONFIG.vocab_size, S, eos=EOS) if documents
            else SyntheticLanguage(CONFIG.vocab_size, 4, seed=0, held_out=True))
  loss, counted = _oracle(source, documents)
  runtime = dataclasses.replace(F32, context_parallel=True)
  graphdef = qwen3.abstract(CONFIG, mesh, runtime=runtime)[0]
  _check(Evaluator(_run_config(documents, runtime), source, graphdef, state, mesh)(state), loss, counted)


def test_eval_only_prints_its_line_and_writes_eval_json(tmp_path, capsys):
  """`relaymoe-train --eval-only` (`evaluate_only`) of a Hugging Face checkpoint: the returned values, eval.json and
  the printed line agree, over the synthetic language's held-out batches (every target counted)."""
  requires_devices(8)
  hf_dir = pathlib.Path(__file__).parent / "fixtures/hf/qwen3_moe"
  config = RunConfig(init_from=f"hf:{hf_dir}", runtime=F32,
                     mesh=MeshConfig(data=2, expert=4), batch_size=B, seq_len=16, out_dir=str(tmp_path / "out"),
                     eval=EvalConfig(batches=2), tensorboard=False)
  values = evaluate_only(resolve_run(config))
  written = json.loads((tmp_path / "out" / "eval.json").read_text())
  assert written == dict(init_from=config.init_from, **values)
  assert values["eval_tokens"] == 2 * B * 16 and 0 < values["eval_loss"] < 2 * math.log(96)
  assert abs(values["eval_ppl"] - math.exp(values["eval_loss"])) <= 1e-9 * values["eval_ppl"]
  line = (f"eval of {hf_dir}: loss {values['eval_loss']:.4f} perplexity {values['eval_ppl']:.2f} over {2 * B * 16} "
          f"tokens of 2 batches ({values['eval_s']:.1f} s)")
  assert line in capsys.readouterr().out.splitlines()


def test_eval_rows_reach_tensorboard_and_metrics_jsonl(tmp_path):
  """The loop's held-out record (`MetricsLog.write(dict(step=..., **evaluator(params)))`): one metrics.jsonl row
  and TensorBoard scalars eval_loss, eval_ppl, eval_tokens and eval_s at its step."""
  values = dict(eval_loss=2.5, eval_ppl=math.exp(2.5), eval_tokens=256, eval_s=0.25)
  log = MetricsLog(tmp_path, total_steps=10, start_step=0, tensorboard=True)
  log.write(dict(step=4, **values))
  log.tensorboard.close()
  assert json.loads((tmp_path / "metrics.jsonl").read_text()) == dict(step=4, **values)
  scalars = tensorboard_scalars(tmp_path / "tensorboard")
  assert {(4, k): pytest.approx(v) for k, v in values.items()} == scalars


def test_eval_forward_is_sized_like_the_steps_micro_batch():
  """With `micro_batches` > 1 the forward is compiled for the micro-batch (an eval needs no more memory than the
  step) and the loss is the same: every piece of every held-out batch counted once."""
  mesh, graphdef, state, tokens, _ = _setup()
  source = TokenWindows(tokens, CONFIG.vocab_size, S, eos=EOS)
  loss, counted = _oracle(source, documents=True, b=2 * B)
  config = dataclasses.replace(_run_config(True), batch_size=2 * B, micro_batches=2)
  evaluator = Evaluator(config, source, graphdef, state, mesh)
  assert {leaf.shape[0] for leaf in jax.tree.leaves(evaluator.compiled.args_info[0][1])} == {B}
  assert source.batch_name == "held-out batch"  # a file cut under the run names the batch, not a step
  _check(evaluator(state), loss, counted)


def test_a_huge_eval_batches_builds_nothing_ahead_and_a_signal_ends_the_eval():
  """eval.batches=1e12 of the synthetic language: the batches are read at each eval, not all held before the first
  step; a signal between batches ends the eval with no result (the loop then saves and stops)."""
  mesh, graphdef, state, _, _ = _setup()
  config = dataclasses.replace(_run_config(False), eval=EvalConfig(every=1, batches=10**12))
  source = SyntheticLanguage(CONFIG.vocab_size, 4, seed=0, held_out=True)
  asked = []
  evaluator = Evaluator(config, source, graphdef, state, mesh, interrupted=lambda: len(asked) > 2 or asked.append(1))
  assert evaluator(state) is None and len(asked) == 3


@pytest.mark.parametrize("every,steps,due", [(0, 5, [4]), (2, 5, [1, 3, 4]), (10, 5, [4])])
def test_eval_every_0_with_held_out_data_takes_the_loss_after_the_last_step(every, steps, due):
  config = dataclasses.replace(_run_config(True), steps=steps, eval=EvalConfig(every=every, path="held_out.bin"))
  assert [step for step in range(steps) if eval_due(config, step)] == due


def test_held_out_data_too_short_for_eval_batches_is_named():
  """A 200-token file for eval.batches=3 of 8 × 32: it was read round again (4011 tokens from 200)."""
  source = TokenWindows(np.arange(200) % CONFIG.vocab_size, CONFIG.vocab_size, S, where="eval.path 'short.bin'")
  with pytest.raises(UserError, match=r"^eval.batches=3 × batch_size=8 needs 24 windows of seq_len\+1=33 tokens, "
                                      r"and eval.path 'short.bin' holds 6 \(200 tokens\): not one batch of "
                                      r"batch_size=8: give more held-out data$"):
    check_held_out(_run_config(True), source)
  with pytest.raises(UserError, match=r"holds 6 \(200 tokens\): at most eval.batches=1$"):
    check_held_out(dataclasses.replace(_run_config(True), batch_size=4), source)
  check_held_out(dataclasses.replace(_run_config(True), batch_size=2), source)


def test_held_out_data_with_no_counted_target_is_named():
  """Only EOS ids: every target follows an EOS, none counts; the loss read 0.0 and the perplexity 1.0."""
  source = TokenWindows(np.full(4 * B * S * BATCHES, EOS), CONFIG.vocab_size, S, where="eval.path 'eos.bin'",
                        eos=EOS)
  with pytest.raises(UserError, match=r"^eval.path 'eos.bin': no target of the 3 held-out batches is in its "
                                      r"input's document \(every input is the EOS id 0, data.eos_token\)"):
    check_held_out(_run_config(True), source)


def test_eval_path_with_the_synthetic_language_is_refused(tmp_path):
  """It was ignored: the "held-out" loss was the synthetic language's, and a missing file went unnoticed."""
  with pytest.raises(UserError, match=r"^eval.path='nowhere.bin' is for data read from a file; the synthetic"):
    make_sources(DataConfig(), EvalConfig(path="nowhere.bin"), CONFIG.vocab_size, S)
