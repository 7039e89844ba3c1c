"""8 emulated CPU devices, set before JAX initialises, and shared helpers for the tests.

On a GPU machine, `pytest` runs on the real GPUs (cases whose mesh needs more devices than exist are skipped, with
the reason); `JAX_PLATFORMS=cpu pytest` runs everything on 8 emulated CPU devices, as CI does.
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402  (after XLA_FLAGS)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402


def requires_devices(count):
  if len(jax.devices()) < count:
    pytest.skip(f"needs {count} devices, {jax.default_backend()} has {len(jax.devices())}")


def mesh_of(shape, names, explicit=False):
  """A mesh over the first prod(shape) devices: Explicit axes as `jax.make_mesh` gives them, or Auto."""
  size = int(np.prod(shape))
  requires_devices(size)
  devices = np.array(jax.devices()[:size])
  if explicit:
    return jax.make_mesh(shape, names, devices=devices)
  return jax.sharding.Mesh(devices.reshape(shape), names)


def relative_error(actual, expected):
  """max |actual − expected| / max |expected|, in float32: the tolerance measure every equivalence test states."""
  actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
  return float(np.max(np.abs(actual - expected)) / max(float(np.max(np.abs(expected))), 1e-30))


def assert_close(actual, expected, rtol, name=""):
  err = relative_error(actual, expected)
  assert np.all(np.isfinite(np.asarray(actual, np.float32))), f"{name}: non-finite values"
  assert err <= rtol, f"{name}: relative error {err:.3g} > {rtol:.3g}"


def random_layer(seed, tokens, d_model, d_ff, num_experts, top_k, *, skew=False, dtype=jnp.float32):
  """Random tokens, routing and SwiGLU experts.

  Uniform routing: each token picks top_k distinct experts at random. Skewed: every token picks from the first
  top_k experts only (all pairs land in partition 0 whenever top_k ≤ L), the worst case for a capacity-bound
  dispatcher and for one hop of the ring.
  """
  rng = np.random.default_rng(seed)
  choices = np.arange(top_k) if skew else np.arange(num_experts)
  idx = np.stack([rng.permutation(choices)[:top_k] for _ in range(tokens)]).astype(np.int32)
  logits = rng.normal(size=(tokens, top_k))
  w = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
  x = rng.normal(size=(tokens, d_model))
  w_gate = rng.normal(size=(num_experts, d_model, d_ff)) / np.sqrt(d_model)
  w_up = rng.normal(size=(num_experts, d_model, d_ff)) / np.sqrt(d_model)
  w_down = rng.normal(size=(num_experts, d_ff, d_model)) / np.sqrt(d_ff)
  as_dtype = lambda a: jnp.asarray(a, dtype)  # noqa: E731
  return dict(x_TD=as_dtype(x), idx_TK=jnp.asarray(idx), w_TK=as_dtype(w), w_gate_EDF=as_dtype(w_gate),
              w_up_EDF=as_dtype(w_up), w_down_EFD=as_dtype(w_down))
