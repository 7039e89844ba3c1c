"""The gated delta rule (`models.attention.gated_delta`, Gated DeltaNet's core), float32 on CPU: the chunked form equals
transformers' chunked and recurrent reference functions (outputs and final state; `pytest.importorskip`), and our
plain recurrence (outputs, final state and every gradient, a nonzero initial state included); packed documents are
independent; state passing over shards (context parallelism's building block) equals the whole sequence."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest


from models.attention.gated_delta import (chunk_transition, combine_transitions, gated_delta_rule,
                                          recurrent_gated_delta_rule)

B, HK, HV, K, V = 2, 2, 4, 16, 16


def make_inputs(seq_len, seed=0, a_max=16.0):
  """Gates as in the model: g = -exp(A_log) softplus(a + dt_bias), A_log = log U(0.01, a_max)."""
  ks = jax.random.split(jax.random.key(seed), 8)
  a_log_H = jnp.log(jax.random.uniform(ks[3], (HV,), minval=0.01, maxval=a_max))
  a_BSH = jax.random.normal(ks[4], (B, seq_len, HV))
  return dict(
      q=jax.random.normal(ks[0], (B, seq_len, HK, K)),
      k=jax.random.normal(ks[1], (B, seq_len, HK, K)),
      v=jax.random.normal(ks[2], (B, seq_len, HV, V)),
      g=-jnp.exp(a_log_H) * jax.nn.softplus(a_BSH + 1.0),
      beta=jax.nn.sigmoid(jax.random.normal(ks[5], (B, seq_len, HV))),
      initial_state=0.5 * jax.random.normal(ks[6], (B, HV, K, V)),
  )


def max_err(a, b):
  return float(jnp.max(jnp.abs(jnp.asarray(a) - jnp.asarray(b))))


@functools.partial(jax.jit, static_argnames=("fn", "chunk_size"))
def run(fn, x, segment_ids=None, chunk_size=64):
  return fn(**x, segment_ids=segment_ids, chunk_size=chunk_size, output_final_state=True)


@functools.partial(jax.jit, static_argnames=("fn",))
def run_and_grads(fn, x, w_o, w_s, segment_ids=None):
  """(o, final state) and the gradients of a random linear functional of them w.r.t. all inputs."""
  def loss(x):
    o, s = fn(**x, segment_ids=segment_ids, output_final_state=True)
    return jnp.sum(o * w_o) + jnp.sum(s * w_s), (o, s)
  (_, (o, s)), dx = jax.value_and_grad(loss, has_aux=True)(x)
  return o, s, dx


def weights(seq_len, seed=1):
  k1, k2 = jax.random.split(jax.random.key(seed))
  return jax.random.normal(k1, (B, seq_len, HV, V)), jax.random.normal(k2, (B, HV, K, V))


def three_documents(seq_len=130):
  """Row 0: boundaries at 40 (inside a chunk) and 64 (a chunk edge); row 1: at 10 and 100."""
  pos = jnp.arange(seq_len)
  return jnp.stack([(pos >= 40).astype(jnp.int32) + (pos >= 64), 3 + (pos >= 10) + (pos >= 100)])


@pytest.mark.parametrize("seq_len", [64, 100, 130])
@pytest.mark.parametrize("with_state", [False, True])
def test_matches_transformers(seq_len, with_state):
  pytest.importorskip("transformers")
  torch = pytest.importorskip("torch")
  hf = pytest.importorskip("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")
  x = make_inputs(seq_len)
  if not with_state:
    x["initial_state"] = None
  o, s = run(gated_delta_rule, x)
  # transformers repeats q, k to the value heads itself (repeat_interleave), so pass Hk heads.
  tx = {n: None if a is None else torch.from_numpy(np.array(a)) for n, a in x.items()}
  for ref in (hf.torch_chunk_gated_delta_rule, hf.torch_recurrent_gated_delta_rule):
    o_ref, s_ref = ref(tx["q"], tx["k"], tx["v"], g=tx["g"], beta=tx["beta"],
                       initial_state=tx["initial_state"], output_final_state=True,
                       use_qk_l2norm_in_kernel=True)
    assert max_err(o, o_ref.numpy()) < 1e-5, ref.__name__
    assert max_err(s, s_ref.numpy()) < 1e-5, ref.__name__


@pytest.mark.parametrize("documents", [False, True])
def test_chunked_matches_recurrent(documents):
  x = make_inputs(130, a_max=1.0)
  seg = three_documents() if documents else None
  o, s = run(gated_delta_rule, x, seg)
  o_ref, s_ref = run(recurrent_gated_delta_rule, x, seg)
  assert max_err(o, o_ref) < 1e-5
  assert max_err(s, s_ref) < 1e-5


@pytest.mark.parametrize("documents", [False, True])
def test_gradients_match_recurrent(documents):
  x = make_inputs(130, a_max=1.0)
  seg = three_documents() if documents else None
  w_o, w_s = weights(130)
  _, _, dx = run_and_grads(gated_delta_rule, x, w_o, w_s, seg)
  _, _, dx_ref = run_and_grads(recurrent_gated_delta_rule, x, w_o, w_s, seg)
  for name in x:
    assert max_err(dx[name], dx_ref[name]) < 1e-5, name


def test_documents_are_independent():
  seq_len = 130
  x = make_inputs(seq_len, a_max=0.5)  # slow decay, so leaks across a boundary would show
  seg = three_documents(seq_len)
  w_o, w_s = weights(seq_len)
  o, s, dx = run_and_grads(gated_delta_rule, x, w_o, w_s, seg)
  for b in range(B):
    starts = [0] + [int(i) for i in jnp.nonzero(jnp.diff(seg[b]))[0] + 1] + [seq_len]
    for d, (lo, hi) in enumerate(zip(starts[:-1], starts[1:])):
      xd = {n: a[b:b + 1, lo:hi] for n, a in x.items() if n != "initial_state"}
      xd["initial_state"] = x["initial_state"][b:b + 1] if d == 0 else None
      last = hi == seq_len
      w_sd = w_s[b:b + 1] if last else jnp.zeros_like(w_s[b:b + 1])
      od, sd, dxd = run_and_grads(gated_delta_rule, xd, w_o[b:b + 1, lo:hi], w_sd)
      assert max_err(o[b, lo:hi], od[0]) < 1e-6, (b, d)
      if last:
        assert max_err(s[b], sd[0]) < 1e-6, b
      for n in ("q", "k", "v", "g", "beta"):
        assert max_err(dx[n][b, lo:hi], dxd[n][0]) < 1e-5, (b, d, n)  # gradients: summation order differs
      if d == 0:
        assert max_err(dx["initial_state"][b], dxd["initial_state"][0]) < 1e-6, b


def test_document_gradients_finite_with_extreme_decay():
  x = make_inputs(130)
  x["g"] = x["g"] * 40.0 - 5.0  # exp(Γ) underflows to zero within a chunk
  w_o, w_s = weights(130)
  _, _, dx = run_and_grads(gated_delta_rule, x, w_o, w_s, three_documents())
  for name, d in dx.items():
    assert bool(jnp.all(jnp.isfinite(d))), name


def test_custom_vjp_saves_only_inputs():
  x = make_inputs(130)
  residuals = jax.vjp(lambda x: run(gated_delta_rule, x, three_documents()), x)[1]
  saved = sum(a.size for a in jax.tree.leaves(residuals))
  inputs = sum(a.size for a in jax.tree.leaves(x)) + B * 130
  assert saved <= inputs, (saved, inputs)


def test_output_dtype_follows_v():
  x = {n: a.astype(jnp.bfloat16) if n in ("q", "k", "v") else a for n, a in make_inputs(64).items()}
  o, s = run(gated_delta_rule, x)
  assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32


def context_parallel(x, seg, num_shards, chunk_size):
  """State passing over shards, as each device would do it after an all-gather."""
  seq_len = x["q"].shape[1]
  bounds = np.linspace(0, seq_len, num_shards + 1).astype(int)
  shards = [{n: a[:, lo:hi] for n, a in x.items() if n != "initial_state"}
            for lo, hi in zip(bounds[:-1], bounds[1:])]
  segs = [None if seg is None else seg[:, lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:])]
  maps = [chunk_transition(**xs, segment_ids=ss, chunk_size=chunk_size)
          for xs, ss in zip(shards, segs)]
  resets = None
  if seg is not None:
    resets = jnp.stack([jnp.zeros(B, bool)] + [seg[:, lo] != seg[:, lo - 1] for lo in bounds[1:-1]])
  states = combine_transitions(jnp.stack([m for m, _ in maps]), jnp.stack([b for _, b in maps]),
                               initial_state=x["initial_state"], resets=resets)
  outs = [gated_delta_rule(**xs, segment_ids=ss, initial_state=s0, chunk_size=chunk_size,
                           output_final_state=True)
          for xs, ss, s0 in zip(shards, segs, states)]
  return jnp.concatenate([o for o, _ in outs], axis=1), outs[-1][1]


@pytest.mark.parametrize("documents", [False, True])
def test_context_parallel_state_passing(documents):
  seq_len = 200
  x = make_inputs(seq_len, a_max=0.5)
  pos = jnp.arange(seq_len)
  # Shards are [0, 50), [50, 100), ...: a boundary inside shard 1 and one at the edge of shard 3.
  seg = jnp.stack([(pos >= 70) + (pos >= 150), (pos >= 100) + 0 * pos]).astype(jnp.int32)
  seg = seg if documents else None
  o, s = run(gated_delta_rule, x, seg)
  o_cp, s_cp = jax.jit(context_parallel, static_argnums=(2, 3))(x, seg, 4, 16)
  assert max_err(o, o_cp) < 1e-5
  assert max_err(s, s_cp) < 1e-5
  w_o, w_s = weights(seq_len)
  loss = lambda fn, x: jnp.sum(fn(x)[0] * w_o) + jnp.sum(fn(x)[1] * w_s)
  dx = jax.grad(functools.partial(loss, lambda x: run(gated_delta_rule, x, seg)))(x)
  dx_cp = jax.jit(jax.grad(functools.partial(
      loss, lambda x: context_parallel(x, seg, 4, 16))))(x)
  for name in x:
    assert max_err(dx[name], dx_cp[name]) < 1e-5, name
