"""The held-out loss (`train.evaluate.Evaluator`) against an independent oracle: optax's cross-entropy over the
model's full float32 logits of the same batches, weighted by the targets in their input's document (a target is
left out after each EOS: the oracle's weights are `inputs != eos`, not `train.data.batches`'), summed over every
batch and divided once by the counted targets; with packed documents, and under context parallelism.

A tiny one-layer model (dense dispatcher: the MoE math is tested elsewhere), float32; 1e-5 relative.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from conftest import requires_devices
from models.qwen3 import model as qwen3
from models.qwen3.config import load_config
from models.runtime import RuntimeConfig
from train.config import DataConfig, EvalConfig, MeshConfig, RunConfig
from train.data.batches import SyntheticLanguage, TokenWindows
from train.evaluate import Evaluator
from train.mesh import build_mesh

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


def _oracle(source, documents):
  """(Σ weight · optax cross-entropy / Σ weight, Σ weight) over the eval batches, from full logits."""
  _, _, state, _, logits = _setup()
  total, count = 0.0, 0.0
  for i in range(BATCHES):
    tokens = source.batch(i, B, S)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    if documents:
      segments = np.concatenate([np.zeros((B, 1), np.int32), np.cumsum(inputs[:, :-1] == EOS, axis=1)], axis=1)
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
