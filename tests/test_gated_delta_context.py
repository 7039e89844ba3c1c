"""Context parallelism for the Gated DeltaNet layers (`models.attention.gated_delta_context`): `qwen3.5-tiny` on a mesh
of 2 data × 4 expert gives, with each sequence split into 8 chunks over the expert devices, the same logits and the
same gradients of its loss as the same parameters without context parallelism, with and without packed documents
(boundaries inside a chunk, one token into a chunk so the conv's halo crosses documents, and exactly at chunk
edges)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import assert_close, requires_devices, trainer_mesh
from models import families
from models.attention.context_parallel import to_held_order, to_sequence_order
from models.attention.gated_delta import gated_delta_rule
from models.attention.gated_delta_context import context_gated_delta_rule, preceding_rows
from models.qwen35.deltanet import GatedDeltaNet
from models.runtime import RuntimeConfig
from relaymoe_jax.errors import UserError

# 8 chunks of 8 tokens over the 4 expert devices; 8 rows, as the model without context parallelism splits rows over
# all 8 devices.
ROWS, LENGTH = 8, 64
RTOL = 1e-5
# Row 0: boundaries inside chunks (13, 30) and one token into chunk 2 (17: the conv's halo crosses documents); row 1:
# boundaries at chunk edges (8, 40, 56: device 1's early chunk, device 2's late chunk, device 0's late chunk).
SEGMENTS = np.tile([np.searchsorted([13, 17, 30], np.arange(LENGTH), side="right"),
                    np.searchsorted([8, 40, 56], np.arange(LENGTH), side="right")], (ROWS // 2, 1)).astype(np.int32)


@pytest.fixture(autouse=True)
def _eight_devices():
  requires_devices(8)


@functools.cache
def _models(span_tokens=0):
  """(without, with context parallelism): the same parameters, only the runtime differs; the second's DeltaNet
  layers in spans of `span_tokens` (0: whole chunks)."""
  config, mesh = families.load_config("qwen3.5-tiny"), trainer_mesh()
  runtime = dict(dtype="float32", dispatcher="dense")
  plain = families.create_sharded(config, mesh, runtime=RuntimeConfig(**runtime, sequence_span_tokens=0))
  split = families.create_sharded(config, mesh, seed=1, runtime=RuntimeConfig(
      **runtime, context_parallel=True, sequence_span_tokens=span_tokens))
  nnx.update(split, nnx.state(plain, nnx.Param))
  return plain, split


def _inputs():
  tokens = np.random.default_rng(0).integers(0, 128, (ROWS, LENGTH + 1)).astype(np.int32)
  return tokens[:, :-1], tokens[:, 1:]


_logits = nnx.jit(lambda model, tokens, segment_ids: model(tokens, segment_ids))


@nnx.jit
def _loss_and_grads(model, tokens, labels, segment_ids):
  loss = lambda model: model.mean_cross_entropy_and_aux(tokens, labels, segment_ids)[0]
  return nnx.value_and_grad(loss)(model)


def _params(grads):
  return jax.tree.map(np.asarray, nnx.to_pure_dict(grads))


def _assert_gradients_close(actual, expected):
  """Every parameter's gradient within RTOL of the largest one: the decay's parameters (a_log, dt_bias, in_a) have
  gradients a thousandth of the others', sums of cancelling terms that two chunkings round apart."""
  scale = max(np.abs(x).max() for x in jax.tree.leaves(expected))
  for path, value in jax.tree_util.tree_leaves_with_path(expected):
    got = functools.reduce(lambda tree, key: tree[key.key], path, actual)
    assert np.abs(got - value).max() <= RTOL * scale, (jax.tree_util.keystr(path), np.abs(got - value).max(), scale)


@pytest.mark.slow  # ~14 s: the gradients' test below runs the same forward through the loss in the default run
@pytest.mark.parametrize("segment_ids", [None, SEGMENTS], ids=["one-document", "documents"])
def test_context_parallel_deltanet_gives_the_same_logits(segment_ids):
  tokens, _ = _inputs()
  plain, split = _models()
  expected = np.asarray(_logits(plain, tokens, segment_ids))
  assert_close(np.asarray(_logits(split, tokens, segment_ids)), expected, RTOL, "logits")


# Spans of 3 cut each chunk of 8 into 3, 3 and 2 (+1 padding): row 0's documents start inside a span (13, 17) and
# at one's first position (30), so the conv's carried history crosses spans, chunks and documents.
SPANS = 3


# The model-level cases (~35-45 s each on 2 cores) run in CI's slow step; the default run checks the DeltaNet layer
# alone below, at once and in spans, and the rule alone.
@pytest.mark.slow
@pytest.mark.parametrize("segment_ids,span_tokens", [(None, 0), (SEGMENTS, 0), (SEGMENTS, SPANS)],
                         ids=["one-document", "documents", "documents-spans"])
def test_context_parallel_deltanet_gives_the_same_gradients(segment_ids, span_tokens):
  """Every parameter's gradient within RTOL of the largest gradient (0.02): the decay's parameters in the first layer
  have gradients of 5e-7, sums of cancelling terms, and the two chunkings round them differently by 5e-9. In spans
  too (`models.qwen35.deltanet`: each chunk's projections, conv and output norm as a scan over spans)."""
  tokens, labels = _inputs()
  plain, split = _models(span_tokens)
  loss, grads = _loss_and_grads(plain, tokens, labels, segment_ids)
  split_loss, split_grads = _loss_and_grads(split, tokens, labels, segment_ids)
  np.testing.assert_allclose(float(split_loss), float(loss), rtol=RTOL)
  _assert_gradients_close(_params(split_grads), _params(grads))


@functools.cache
def _layers(span_tokens):
  """(without, with context parallelism): one Gated DeltaNet layer of `qwen3.5-tiny`, the same parameters; the second
  in spans of `span_tokens` (0: whole chunks)."""
  config, mesh = families.load_config("qwen3.5-tiny"), trainer_mesh()
  runtime = dict(dtype="float32", dispatcher="dense")
  plain = GatedDeltaNet(config, RuntimeConfig(**runtime, sequence_span_tokens=0), mesh, nnx.Rngs(0))
  # Decays near 0.97 a token (initialised, 0.3 to 1e-8): the state carried across spans and chunks shows.
  plain.a_log_Q[...] = jnp.full(plain.a_log_Q.shape, np.log(0.03))
  split = GatedDeltaNet(config, RuntimeConfig(**runtime, context_parallel=True, sequence_span_tokens=span_tokens), mesh,
                        nnx.Rngs(1))
  nnx.update(split, nnx.state(plain, nnx.Param))
  return plain, split


@nnx.jit(static_argnums=4)
def _layer_loss_and_grads(layer, x_BSD, w_BSD, segment_ids, ring):
  """sum(layer(x) · w) and its gradients for the layer's parameters and x; `ring` > 1: x and the segment ids enter
  in held order over that many devices and the output leaves in sequence order, as the model does it."""
  held = (lambda x: x) if ring == 1 else (lambda x: to_held_order(x, ring))
  back = (lambda x: x) if ring == 1 else (lambda x: to_sequence_order(x, ring))

  def loss(layer, x_BSD):
    return jnp.sum(back(layer(held(x_BSD), None, held(segment_ids))) * w_BSD)

  return nnx.value_and_grad(loss, argnums=(0, 1))(layer, x_BSD)


@pytest.mark.parametrize("span_tokens", [0, SPANS], ids=["whole", "spans"])
def test_the_context_parallel_deltanet_layer_is_the_whole_sequences(span_tokens):
  """One layer on random inputs with documents (SEGMENTS): output and the gradients of every parameter and of the
  input, each within RTOL of its largest entry, context-parallel (at once, and in spans: the conv's history and the
  state carried across spans and chunks, a first scan for the chunks' maps) against the plain layer."""
  plain, split = _layers(span_tokens)
  rng = np.random.default_rng(2)
  x, w = (jnp.asarray(rng.normal(size=(ROWS, LENGTH, plain.in_qkv_DC.shape[0])), jnp.float32) for _ in range(2))
  segment_ids = jnp.asarray(SEGMENTS)
  expected = _layer_loss_and_grads(plain, x, w, segment_ids, 1)
  actual = _layer_loss_and_grads(split, x, w, segment_ids, trainer_mesh().shape["expert"])
  (loss, (grads, dx)), (split_loss, (split_grads, split_dx)) = expected, actual
  assert_close((split_loss, split_dx), (loss, dx), RTOL, "output and input gradient")
  _assert_gradients_close(_params(split_grads), _params(grads))


@pytest.mark.parametrize("segment_ids,state_kernel", [(None, "xla"), (SEGMENTS[:2], "xla"),
                                                      pytest.param(SEGMENTS[:2], "pallas", marks=pytest.mark.slow)],
                         ids=["one-document", "documents", "documents-pallas"])
def test_context_gated_delta_rule_matches_the_whole_sequence(segment_ids, state_kernel):
  """The rule alone on random inputs (decays up to 0.5 a token, so the passed state matters): output and every
  input's gradient, each within RTOL of its largest entry; with the Pallas state kernels too (what GPUs run)."""
  rng = np.random.default_rng(1)
  q, k, v, w = (rng.normal(size=(2, LENGTH, 2, 8)).astype(np.float32) for _ in range(4))
  g, beta = -rng.uniform(0.01, 0.5, (2, LENGTH, 2)), rng.uniform(0.1, 0.9, (2, LENGTH, 2))
  held = lambda x: None if x is None else to_held_order(jnp.asarray(x), 4)

  def whole(*args):
    return jnp.sum(gated_delta_rule(*args, segment_ids=segment_ids)[0] * w)

  def split(*args):
    o, _ = context_gated_delta_rule(*map(held, args), mesh=trainer_mesh(), segment_ids=held(segment_ids),
                                    state_kernel=state_kernel)
    return jnp.sum(to_sequence_order(o, 4) * w)

  inputs = [jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta)]
  expected = jax.jit(jax.value_and_grad(whole, argnums=range(5)))(*inputs)
  actual = jax.jit(jax.value_and_grad(split, argnums=range(5)))(*inputs)
  assert_close(actual, expected, RTOL, "output and gradients")


def test_chunks_shorter_than_the_conv_history_are_named():
  with pytest.raises(UserError, match="chunks of 2 tokens are shorter than the DeltaNet conv's 3 tokens of history"):
    preceding_rows(jnp.zeros((2, 16, 4)), 3, mesh=trainer_mesh())
