"""`Spans.scan` (`models.span_scan`): `lax.scan(jax.checkpoint(body), ...)`'s values and gradients, on random
float32 data, for a body with what Qwen3.5's layers give it (a carry with an integer leaf, inputs with integer ids
and a second float input, two outputs, weights closed over); and no buffer of its outputs' or input gradients' size
made from a constant (XLA makes all such broadcasts together, before the first loop), none at all for input
gradients that can be written over output gradients."""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from conftest import assert_close, broadcast_constants, jaxpr_equations
from models.spans import SPAN_GRANULE, Spans

P, T, D, Z = 5, 4, 6, 3
SPANS = Spans.of(P * T, 1, T)  # one chunk of P spans of T
RNG = np.random.default_rng(0)
W = jnp.asarray(RNG.normal(size=(D, D)), jnp.float32)
X = jnp.asarray(RNG.normal(size=(P, T, D)), jnp.float32)
OUT = jnp.asarray(RNG.normal(size=(P, T, Z)), jnp.float32)
SEG = jnp.asarray(RNG.integers(0, 2, (P, T)), jnp.int32)
H0 = jnp.asarray(RNG.normal(size=(D,)), jnp.float32)


def _outputs(scan, w, x, out, h0):
  """Spans of a body whose carry (a state and the last span's id) and both outputs are returned."""

  def body(carry, xs):
    h, last = carry
    x_TD, out_TZ, seg_T = xs
    same = (seg_T[:, None] == last).astype(jnp.float32)
    y_TD = jnp.tanh(x_TD @ w + h) * (1 + same) + out_TZ.sum(-1, keepdims=True)
    return (0.5 * h + y_TD.mean(0), seg_T[-1]), (y_TD, out_TZ * y_TD[:, :Z])

  (h, _), (y, y2) = scan(body, (h0, jnp.int32(1)), (x, out, SEG))
  return h, y, y2


def _loss(scan, *args):
  h, y, y2 = _outputs(scan, *args)
  return jnp.sum(y * jnp.cos(y)) + jnp.sum(jnp.sin(y2)) + jnp.sum(jnp.sin(h))


_plain = jax.jit(jax.value_and_grad(
    lambda *a: _loss(lambda body, carry, xs: lax.scan(jax.checkpoint(body), carry, xs), *a), argnums=(0, 1, 2, 3)))
_spans = jax.jit(jax.value_and_grad(lambda *a: _loss(SPANS.scan, *a), argnums=(0, 1, 2, 3)))


def test_span_scan_is_lax_scans_value_and_gradients():
  (loss, grads), (expected, expected_grads) = _spans(W, X, OUT, H0), _plain(W, X, OUT, H0)
  np.testing.assert_allclose(float(loss), float(expected), rtol=1e-6)
  for name, got, want in zip(("w", "x", "out", "h0"), grads, expected_grads):
    assert_close(np.asarray(got), np.asarray(want), 1e-5, name)


def test_span_scan_makes_no_output_sized_buffer_from_a_constant():
  """The forward's outputs and the backward's input gradients are made from the loop's data: no `scan` that stacks
  outputs (XLA starts them from a broadcast constant; a loop of carries only is a scan too) and no broadcast of a
  literal to a [P, ...] shape."""
  def values_and_vjp(w, x, out, h0, cotangents):
    outputs, vjp = jax.vjp(lambda *a: _outputs(SPANS.scan, *a), w, x, out, h0)
    return outputs, vjp(cotangents)

  cotangents = tuple(jnp.asarray(RNG.normal(size=shape), jnp.float32) for shape in ((D,), (P, T, D), (P, T, Z)))
  jaxpr = jax.make_jaxpr(values_and_vjp)(W, X, OUT, H0, cotangents)
  equations = list(jaxpr_equations(jaxpr.jaxpr))
  assert all(len(e.outvars) == e.params["num_carry"] for e in equations if e.primitive.name == "scan")
  from_constants = broadcast_constants(jaxpr.jaxpr, lambda shape: len(shape) > 0 and shape[0] == P)
  assert not from_constants, from_constants
  # x's gradient is written over y's, out's over y2's (their shapes): only the forward's two outputs are made.
  made = [e for e in equations if e.primitive.name == "broadcast_in_dim" and e.outvars[0].aval.shape[:2] == (P, T)]
  assert len(made) == 2, made


def test_long_spans_are_whole_granules_as_even_as_they_can_be():
  """A span's positions are a multiple of SPAN_GRANULE (128; of the span asked where that is less): the 40-layer
  Qwen3.5 step under context parallelism at 4,505,600 tokens, spans of about 16384, had spans of 15645 positions,
  whose matmuls XLA's GPU tiling failed to compile. The spans still cover the chunk, the last one padded by less
  than a span."""
  for seq_len, chunks, asked in ((4505600, 16, 16384), (2162688, 16, 16384), (1163264, 1, 32768), (24, 3, 3),
                                 (100, 1, 24), (262144, 1, 32768)):
    spans = Spans.of(seq_len, chunks, asked)
    assert spans.length % min(SPAN_GRANULE, asked) == 0, (seq_len, spans)
    assert (spans.count - 1) * spans.length < spans.chunk <= spans.count * spans.length, (seq_len, spans)
  assert Spans.of(4505600, 16, 16384) == Spans(chunks=16, chunk=281600, count=18, length=15744)
  assert Spans.of(4096, 1, 32768) == Spans(chunks=1, chunk=4096, count=1, length=4096)
