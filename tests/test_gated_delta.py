"""The gated delta rule (`models.attention.gated_delta`, Gated DeltaNet's core), float32 on CPU: the chunked form equals
transformers' chunked and recurrent reference functions (outputs and final state; `pytest.importorskip`), and our
plain recurrence (outputs, final state and every gradient, a nonzero initial state included); packed documents are
independent; state passing over shards (context parallelism's building block) equals the whole sequence."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from models.attention import gated_delta as gd, gated_delta_backward_kernels as gbk, gated_delta_kernels as gk
from models.attention.gated_delta import (chunk_transition, combine_transitions, gated_delta_rule,
                                          recurrent_gated_delta_rule)

B, HK, HV, K, V = 2, 2, 4, 16, 16

def make_inputs(seq_len, seed=0, a_max=16.0):
  """Gates as in the model: g = -exp(A_log) softplus(a + dt_bias), A_log = log U(0.01, a_max)."""
  rng = np.random.default_rng(seed)
  normal = lambda *shape: rng.standard_normal(shape, dtype=np.float32)
  a_H = rng.uniform(0.01, a_max, HV).astype(np.float32)
  return dict(
      q=normal(B, seq_len, HK, K),
      k=normal(B, seq_len, HK, K),
      v=normal(B, seq_len, HV, V),
      g=-a_H * np.logaddexp(0.0, normal(B, seq_len, HV) + 1.0),
      beta=1.0 / (1.0 + np.exp(-normal(B, seq_len, HV))),
      initial_state=0.5 * normal(B, HV, K, V),
  )

def weights(seq_len, seed=1):
  rng = np.random.default_rng(seed)
  return (rng.standard_normal((B, seq_len, HV, V), dtype=np.float32),
          rng.standard_normal((B, HV, K, V), dtype=np.float32))

def three_documents(seq_len=130):
  """Row 0: boundaries at 40 (inside a chunk) and 64 (a chunk edge); row 1: at 10 and 100."""
  pos = np.arange(seq_len)
  return np.stack([(pos >= 40).astype(np.int32) + (pos >= 64), 3 + (pos >= 10) + (pos >= 100)]).astype(np.int32)

def max_err(a, b):
  return float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))

@functools.partial(jax.jit, static_argnames=("fn",))
def run_and_grads(fn, x, w_o, w_s, segment_ids):
  """(o, final state) and the gradients of a linear functional of them w.r.t. every input."""
  def loss(x):
    o, s = fn(**x, segment_ids=segment_ids, output_final_state=True)
    return jnp.sum(o * w_o) + jnp.sum(s * w_s), (o, s)
  (_, (o, s)), dx = jax.value_and_grad(loss, has_aux=True)(x)
  return o, s, dx

@jax.jit
def with_and_without_state(x):
  out = gated_delta_rule(**x, output_final_state=True)
  x = dict(x, initial_state=None)
  return out, gated_delta_rule(**x, output_final_state=True)

@pytest.mark.parametrize("seq_len", [64, 100, 130])
def test_matches_transformers(seq_len):
  pytest.importorskip("transformers")
  torch = pytest.importorskip("torch")
  hf = pytest.importorskip("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")
  x = make_inputs(seq_len)
  outs = with_and_without_state(x)
  t = {n: torch.from_numpy(a) for n, a in x.items()}
  for (o, s), s0 in zip(outs, (t["initial_state"], None)):
    for ref in (hf.torch_chunk_gated_delta_rule, hf.torch_recurrent_gated_delta_rule):
      # Takes q, k with Hk heads and repeat_interleaves them to Hv itself.
      o_ref, s_ref = ref(t["q"], t["k"], t["v"], g=t["g"], beta=t["beta"], initial_state=s0,
                         output_final_state=True, use_qk_l2norm_in_kernel=True)
      assert max_err(o, o_ref.numpy()) < 1e-5, (ref.__name__, s0 is None)
      assert max_err(s, s_ref.numpy()) < 1e-5, (ref.__name__, s0 is None)

def test_value_head_j_uses_key_head_j_div_ratio():
  x = make_inputs(64)
  y = dict(x, q=x["q"].copy(), k=x["k"].copy())
  y["q"][:, :, 1] += 1.0
  y["k"][:, :, 1] -= 1.0
  run = jax.jit(lambda x: gated_delta_rule(**x)[0])
  diff_H = np.abs(np.asarray(run(x)) - np.asarray(run(y))).max(axis=(0, 1, 3))
  assert np.all(diff_H[:2] == 0) and np.all(diff_H[2:] > 1e-3), diff_H  # Hv // Hk = 2

@pytest.mark.parametrize("documents", [False, True])
def test_matches_recurrent_with_gradients(documents):
  x = make_inputs(130, a_max=1.0)
  seg = three_documents() if documents else np.zeros((B, 130), np.int32)
  w_o, w_s = weights(130)
  o, s, dx = run_and_grads(gated_delta_rule, x, w_o, w_s, seg)
  o_ref, s_ref, dx_ref = run_and_grads(recurrent_gated_delta_rule, x, w_o, w_s, seg)
  assert max_err(o, o_ref) < 1e-5
  assert max_err(s, s_ref) < 1e-5
  for name in x:
    assert max_err(dx[name], dx_ref[name]) < 1e-5, name


def test_the_xla_forms_loop_over_chunks_has_autodiffs_gradients():
  """`_state_loop`'s written-out VJP (two matmuls a chunk backwards) against autodiff of the same loop, float32."""
  rng = np.random.default_rng(3)
  n, b, h, c, k, v = 5, 2, 3, 4, 6, 7
  rand = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
  args = (rand(n, b, h, c, v), rand(n, b, h, c, k), rand(n, b, h, c, k),
          jnp.asarray(rng.uniform(0.5, 1.0, (n, b, h)), jnp.float32), rand(b, h, k, v))
  cotangents = (rand(n, b, h, k, v), rand(n, b, h, c, v), rand(b, h, k, v))
  with jax.default_matmul_precision("highest"):
    ours = jax.vjp(gd._state_loop, *args)[1](cotangents)
    autodiff = jax.vjp(lambda *a: gd._state_loop_fwd(*a)[0], *args)[1](cotangents)
  for name, a, r in zip(("u", "w", "kd", "decay", "state"), ours, autodiff):
    np.testing.assert_allclose(a, r, rtol=1e-5, atol=1e-5 * float(jnp.abs(r).max()), err_msg=name)


@pytest.mark.parametrize("documents", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_the_pallas_kernels_match_recurrent_with_gradients(documents):
  """The kernel path (the forward's three kernels and the backward's five, in Pallas' interpreter here; `pytest -m
  gpu` runs them compiled): outputs, final state and every gradient, at K = V = 2 × BLOCK_V so that the state pass
  runs several blocks of V and the backward's programs loop over two blocks of each. Mutants killed: the inverse's
  block-merge sign or its diagonal blocks' substitution sign flipped, A's diagonal kept, U without β or without its
  diagonal block, W without m, the output without its causal mask or without m, the decay left out of dS, dV_new
  without Kd dS; in the backward kernels (25): the output's dΓ without D's column term or through Qd dropped, P's
  dΓ terms in every block of K (or the blocks' dΓ not summed, or only the first block), its dQ without m exp(Γ),
  its dK without D, only its first value head, ∂V_new from P untransposed, ∂S_n dropped or without m, dW's sign,
  Kd's dK or dΓ dropped, the state's decay's dΓ without exp(Γ_C), only the first value head or block of V of dW,
  dβ through W without m exp(Γ), dA without β, dK through A one-sided, A's diagonal kept, dV without β, dT without
  dW Xwᵀ, only the first value head of `wy_backward`, only the first block of columns anywhere, dk not through k's
  norm, Kd's part of dK not added; v read at the first
  value head by `chunk_wy` or `wy_backward`, dV written there, Kd without its decay in either state pass, writes and
  reads swapped in the backward's, a value head's key head wrong in the state passes."""
  x = make_inputs(130, a_max=1.0)
  rng = np.random.default_rng(2)
  wide = 2 * gk.BLOCK_V
  x["q"], x["k"] = (np.concatenate([x[n], rng.standard_normal(x[n].shape[:-1] + (wide - K,), np.float32)], axis=-1)
                    for n in ("q", "k"))
  x["v"] = np.concatenate([x["v"]] * (wide // V), axis=-1)
  x["initial_state"] = 0.5 * rng.standard_normal((B, HV, wide, wide), np.float32)
  seg = three_documents() if documents else np.zeros((B, 130), np.int32)
  w_o = rng.standard_normal(x["v"].shape, dtype=np.float32)
  w_s = rng.standard_normal(x["initial_state"].shape, dtype=np.float32)
  o, s, dx = run_and_grads(functools.partial(gated_delta_rule, state_kernel="pallas"), x, w_o, w_s, seg)
  o_ref, s_ref, dx_ref = run_and_grads(recurrent_gated_delta_rule, x, w_o, w_s, seg)
  assert max_err(o, o_ref) < 1e-5 and max_err(s, s_ref) < 1e-5
  for name in x:
    assert max_err(dx[name], dx_ref[name]) < 1e-5 * max(1.0, np.abs(dx_ref[name]).max()), name

def test_a_kernel_program_takes_a_run_of_chunks_as_one_chunk_each(monkeypatch):
  """The kernels whose programs take runs of chunks (`chunk_wy`, `output_value_backward`, `state_inputs_backward`),
  at runs of 2: outputs, final state and every gradient bit for bit what one chunk a program gives (4 chunks a row,
  documents, K = V = 16). Mutants killed: every chunk of a run read or written at the run's first, in each kernel;
  the run's axis wrong for the value heads' refs; the grid over chunks, not runs."""
  x = make_inputs(256, a_max=1.0)
  seg = three_documents(256)
  w_o, w_s = weights(256)

  def at_most(per):
    for module, name in ((gk, "WY_CHUNKS"), (gbk, "OUTPUT_VALUE_CHUNKS"), (gbk, "STATE_INPUTS_CHUNKS")):
      monkeypatch.setattr(module, name, per)
    return run_and_grads(functools.partial(gated_delta_rule, state_kernel="pallas"), x, w_o, w_s, seg)

  (o, s, dx), (o_one, s_one, dx_one) = at_most(2), at_most(1)
  np.testing.assert_array_equal(o, o_one)
  np.testing.assert_array_equal(s, s_one)
  for name in x:
    np.testing.assert_array_equal(dx[name], dx_one[name], err_msg=name)


@pytest.mark.parametrize("state_kernel", ["xla", "pallas"])
def test_without_the_l2_norm_q_is_only_scaled(state_kernel):
  """`l2_normalize=False` (q scaled by K^-1/2, k as given; keys of norm about 0.8 keep the rule stable): outputs, final
  state and every gradient as the recurrence's, float32, 1e-5 of the largest, documents and an initial state; the
  outputs linear in q (twice q, twice o); on q and k normalised beforehand, the outputs of the rule normalising them
  itself. Mutants killed: the flag dropped on the way to either form, or ignored where both normalise (q and k
  normalised anyway)."""
  x = make_inputs(130, a_max=1.0)
  x["q"], x["k"] = x["q"] * 0.2, x["k"] * 0.2
  seg = three_documents()
  w_o, w_s = weights(130)
  rule = functools.partial(gated_delta_rule, state_kernel=state_kernel, l2_normalize=False)
  o, s, dx = run_and_grads(rule, x, w_o, w_s, seg)
  o_ref, s_ref, dx_ref = run_and_grads(functools.partial(recurrent_gated_delta_rule, l2_normalize=False), x, w_o,
                                       w_s, seg)
  relative = lambda a, r: max_err(a, r) / np.abs(np.asarray(r, np.float32)).max()
  assert relative(o, o_ref) < 1e-5 and relative(s, s_ref) < 1e-5
  for name in x:
    assert relative(dx[name], dx_ref[name]) < 1e-5, name
  o_twice, _, _ = run_and_grads(rule, dict(x, q=2 * x["q"]), w_o, w_s, seg)
  assert relative(o_twice, 2 * o_ref) < 1e-5
  unit = {n: a / np.linalg.norm(a, axis=-1, keepdims=True) if n in "qk" else a for n, a in x.items()}
  o_unit, s_unit, _ = run_and_grads(rule, unit, w_o, w_s, seg)
  o_norm, s_norm, _ = run_and_grads(recurrent_gated_delta_rule, x, w_o, w_s, seg)
  assert relative(o_unit, o_norm) < 1e-5 and relative(s_unit, s_norm) < 1e-5

@pytest.mark.parametrize("state_kernel", ["xla", "pallas"])
def test_bfloat16_chunk_operands_stay_near_the_float32_recurrence(state_kernel):
  """bfloat16 operands with float32 accumulation (the XLA form's `chunk_dtype=bfloat16`; the kernel path's own
  choice for bfloat16 inputs) on bfloat16 inputs: outputs, final state and every gradient within 3e-2 of the float32
  recurrence, relative to the largest value (bfloat16's own rounding of the inputs gives about 1e-2). Mutants
  killed: (I + A)⁻¹ applied to V without β, Q·Kᵀ without its decay."""
  x = make_inputs(130, a_max=1.0)
  low = {n: a.astype(jnp.bfloat16) if n in "qkv" else a for n, a in x.items()}
  seg = three_documents()
  w_o, w_s = weights(130)
  rule = functools.partial(gated_delta_rule, state_kernel=state_kernel,
                           chunk_dtype=jnp.bfloat16 if state_kernel == "xla" else None)
  o, s, dx = run_and_grads(rule, low, w_o, w_s, seg)
  o_ref, s_ref, dx_ref = run_and_grads(recurrent_gated_delta_rule, x, w_o, w_s, seg)
  relative = lambda a, r: max_err(a, r) / np.abs(np.asarray(r, np.float32)).max()
  assert relative(o, o_ref) < 3e-2 and relative(s, s_ref) < 3e-2
  for name in x:
    assert relative(dx[name], dx_ref[name]) < 3e-2, name

@pytest.mark.parametrize("state_kernel", [pytest.param("xla", marks=pytest.mark.slow), "pallas"])
def test_a_row_in_spans_is_the_whole_row(state_kernel):
  """A row longer than `span_tokens` runs as a scan over spans, the state carried: outputs, final state and every
  gradient as the whole row at once (float32, 1e-5 of the largest), with an initial state and documents, one of them
  starting exactly at a span's edge (row 0 at 64), and a last span of 2 positions padded. Mutants killed: the state
  not zeroed where a span begins a new document; padding with the first document instead of the last; on the kernel
  path, whose VJP recomputes each span's inverses instead of keeping them, a wrong recomputed inverse."""
  x = make_inputs(130, a_max=1.0)
  seg = three_documents()
  w_o, w_s = weights(130)
  rule = functools.partial(gated_delta_rule, state_kernel=state_kernel)
  o, s, dx = run_and_grads(functools.partial(rule, span_tokens=64), x, w_o, w_s, seg)
  o_ref, s_ref, dx_ref = run_and_grads(functools.partial(rule, span_tokens=None), x, w_o, w_s, seg)
  relative = lambda a, r: max_err(a, r) / np.abs(np.asarray(r, np.float32)).max()
  assert relative(o, o_ref) < 1e-5 and relative(s, s_ref) < 1e-5
  for name in x:
    assert relative(dx[name], dx_ref[name]) < 1e-5, name


def test_the_kernels_lower_to_triton_for_a_gpu():
  """Pallas' Triton lowering of the kernel path's eight kernels, forward and backward, bfloat16 at the 35B model's
  head sizes, run here by exporting the jitted loss and gradient for CUDA (no GPU needed; a program lowered for CUDA
  takes the kernels whatever machine lowers it): what a GPU would first refuse (an op with no Triton lowering, a load
  whose size is not a power of 2). Triton's own compilation is `pytest -m gpu`'s. Mutants killed: a state-pass block
  of 48 columns; the interpreter chosen by the lowering machine's backend (no kernel in the program)."""
  b, s, hk, hv, k = 1, 96, 1, 2, 128
  bf16 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)

  def loss(q, k_, v, g, beta, state, seg):
    o, final = gated_delta_rule(q, k_, v, g, beta, segment_ids=seg, initial_state=state, output_final_state=True,
                                state_kernel="pallas")
    return jnp.sum(o.astype(jnp.float32)) + jnp.sum(final)

  exported = export.export(jax.jit(jax.value_and_grad(loss, argnums=tuple(range(6)))), platforms=["cuda"],
                           disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
      bf16(b, s, hk, k), bf16(b, s, hk, k), bf16(b, s, hv, k), f32(b, s, hv), f32(b, s, hv), f32(b, hv, k, k),
      jax.ShapeDtypeStruct((b, s), jnp.int32))
  kernels = set(re.findall(r'name = "(gated_delta_\w+)"', exported.mlir_module()))
  assert kernels == {"gated_delta_chunk_wy", "gated_delta_state_forward", "gated_delta_chunk_output",
                     "gated_delta_output_backward", "gated_delta_output_value_backward",
                     "gated_delta_state_backward", "gated_delta_state_inputs_backward", "gated_delta_wy_backward"}

@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tolerance", [(jnp.float32, 1e-4), (jnp.bfloat16, 3e-2)])
def test_on_a_gpu_the_compiled_pallas_kernels_match_the_xla_form(dtype, tolerance):
  """Compiled by Triton at the 35B model's head sizes (K = V = 128), with documents: outputs, final state and every
  gradient against XLA's float32 form (max |a − b| / max |b|); bfloat16 inputs take bfloat16 operands."""
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU; run `pytest -m gpu` there")
  rng = np.random.default_rng(0)
  b, s, hk, hv, k = 2, 512, 2, 4, 128  # 8 chunks: the kernels that take runs of chunks take runs of 4
  normal = lambda *shape: rng.standard_normal(shape, dtype=np.float32)
  x = dict(q=normal(b, s, hk, k), k=normal(b, s, hk, k), v=normal(b, s, hv, k),
           g=-np.logaddexp(0.0, normal(b, s, hv)), beta=1.0 / (1.0 + np.exp(-normal(b, s, hv))),
           initial_state=0.5 * normal(b, hv, k, k))
  seg = np.stack([np.arange(s) >= 100, np.arange(s) >= 256]).astype(np.int32)
  w_o, w_s = normal(b, s, hv, k), normal(b, hv, k, k)
  low = {n: a.astype(dtype) if n in "qkv" else a for n, a in x.items()}
  rule = functools.partial(gated_delta_rule, state_kernel="pallas")
  o, st, dx = run_and_grads(rule, low, w_o, w_s, seg)
  o_ref, st_ref, dx_ref = run_and_grads(gated_delta_rule, x, w_o, w_s, seg)
  relative = lambda a, r: max_err(a, r) / np.abs(np.asarray(r, np.float32)).max()
  assert relative(o, o_ref) < tolerance and relative(st, st_ref) < tolerance
  for name in x:
    assert relative(dx[name], dx_ref[name]) < tolerance, name

def test_documents_are_independent():
  seq_len = 130
  x = make_inputs(seq_len, a_max=1.0)  # slow decay, so a leak across a boundary would show
  seg = three_documents(seq_len)
  w_o, w_s = weights(seq_len)
  o, s, dx = jax.device_get(run_and_grads(gated_delta_rule, x, w_o, w_s, seg))
  # Each document alone in its own row, right-padded with g = beta = 0 no-op tokens.
  docs = []
  for b in range(B):
    edges = [0] + list(np.nonzero(np.diff(seg[b]))[0] + 1) + [seq_len]
    docs += [(b, lo, hi) for lo, hi in zip(edges[:-1], edges[1:])]

  def alone(a_BS):
    out = np.zeros((len(docs),) + a_BS.shape[1:], a_BS.dtype)
    for i, (b, lo, hi) in enumerate(docs):
      out[i, :hi - lo] = a_BS[b, lo:hi]
    return out

  xd = {n: alone(a) for n, a in x.items() if n != "initial_state"}
  xd["initial_state"] = np.stack([x["initial_state"][b] * (lo == 0) for b, lo, _ in docs])
  w_sd = np.stack([w_s[b] * (hi == seq_len) for b, _, hi in docs])
  no_docs = np.zeros((len(docs), seq_len), np.int32)
  od, sd, dxd = jax.device_get(run_and_grads(gated_delta_rule, xd, alone(w_o), w_sd, no_docs))
  for i, (b, lo, hi) in enumerate(docs):
    assert max_err(o[b, lo:hi], od[i, :hi - lo]) < 1e-6, (b, lo)
    if hi == seq_len:
      assert max_err(s[b], sd[i]) < 1e-6, b
    for n in ("q", "k", "v", "g", "beta"):
      ref = dxd[n][i, :hi - lo]
      # Other chunk alignment, so other float32 rounding of sums over up to 130 tokens.
      assert max_err(dx[n][b, lo:hi], ref) < 1e-5 * max(1.0, np.abs(ref).max()), (b, lo, n)
    if lo == 0:
      assert max_err(dx["initial_state"][b], dxd["initial_state"][i]) < 1e-6, b

def test_document_gradients_finite_with_extreme_decay():
  x = make_inputs(130)
  x["g"] = x["g"] * 40.0 - 5.0  # exp(Γ) underflows to zero within a chunk
  w_o, w_s = weights(130)
  _, _, dx = run_and_grads(gated_delta_rule, x, w_o, w_s, three_documents())
  for name, d in dx.items():
    assert np.all(np.isfinite(d)), name

def test_custom_vjp_saves_only_inputs_and_the_kernel_paths_state_pass():
  """The XLA form keeps only its inputs; the kernel path also each chunk's (I + A)⁻¹ [C, C], W [C, K], entering
  state [K, V] and V_new [C, V] per value head for a row in one span, and over spans only what the XLA form keeps
  (one span's state pass at a time, rerun)."""
  x = make_inputs(130)
  seg = three_documents()

  def saved(fn):
    f = lambda x: fn(**x, segment_ids=seg, output_final_state=True)
    residuals = jax.eval_shape(lambda x: jax.vjp(f, x)[1], x)
    return sum(a.size for a in jax.tree.leaves(residuals))

  inputs = sum(a.size for a in x.values()) + seg.size
  assert saved(gated_delta_rule) <= inputs
  plain = lambda q, k, v, g, beta, initial_state, **_: gd._chunked_forward(
      q, k, v, g, beta, seg, initial_state, 64, True, None)
  assert saved(plain) > 2 * inputs  # plain autodiff keeps per-chunk states and matrices
  kernels = functools.partial(gated_delta_rule, state_kernel="pallas")
  state_pass = B * HV * 3 * (64 * 64 + 64 * K + K * V + 64 * V)  # 130 positions: 3 chunks of 64
  assert saved(kernels) == inputs + state_pass
  # Over spans the scan keeps the padded inputs and each span's entering state, both paths alike.
  xla_spans = functools.partial(gated_delta_rule, span_tokens=64)
  assert saved(functools.partial(kernels, span_tokens=64)) <= saved(xla_spans)

def test_the_kernel_path_names_a_chunk_size_it_cannot_take():
  """Triton's blocks need a power-of-2 chunk of at least 16: another is refused by name, not miscomputed."""
  x = make_inputs(64, a_max=1.0)
  with pytest.raises(ValueError, match="chunk_size=48"):
    gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], chunk_size=48, state_kernel="pallas")

@pytest.mark.parametrize("name,bad,message", [
    ("beta", lambda x: x[:, :-1], r"beta has shape \(2, 63, 4\);.* must be \(2, 64, 4\)"),
    ("g", lambda x: x[:, :, :2], r"g has shape \(2, 64, 2\)"),
    ("segment_ids", lambda _: np.zeros((B, 60), np.int32), r"segment_ids has shape \(2, 60\)"),
    ("initial_state", lambda x: x[..., :-1], r"initial_state has shape \(2, 4, 16, 15\)"),
    ("v", lambda x: x[:, :-1], r"q and k \(2, 64, 2, 16\) and v \(2, 63, 4, 16\) differ in \[B, S\]"),
    ("k", lambda x: x[..., :-1], r"q \(2, 64, 2, 16\) and k \(2, 64, 2, 15\) differ"),
    ("v", lambda x: x[:, :, :3], "3 value heads are not a multiple of 2 key heads"),
    ("chunk_size", lambda _: 0, "chunk_size=0 must be a positive integer"),
], ids=["beta_short", "g_heads", "segment_ids_short", "state_width", "v_short", "k_width", "v_heads", "chunk_zero"])
@pytest.mark.parametrize("rule", [gated_delta_rule, recurrent_gated_delta_rule])
def test_inputs_that_do_not_fit_together_are_named(rule, name, bad, message):
  """A shorter β or segment_ids would be padded silently to whole chunks; the rest would fail deep in XLA."""
  x = make_inputs(64)
  x[name] = bad(x.get(name))
  with pytest.raises(ValueError, match=message):
    rule(**x)

def test_output_dtype_follows_v():
  x = {n: a.astype(jnp.bfloat16) if n in "qkv" else a for n, a in make_inputs(64).items()}
  o, s = jax.eval_shape(lambda x: gated_delta_rule(**x, output_final_state=True), x)
  assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32

@functools.partial(jax.jit, static_argnums=(3, 4))
def context_parallel(x, w_o, w_s, num_shards, chunk_size, segment_ids):
  """State passing over equal shards (vmapped here, one per device in a real run), with grads."""
  def loss(x):
    shard = lambda a: jnp.moveaxis(a.reshape(B, num_shards, -1, *a.shape[2:]), 1, 0)
    xs = {n: shard(a) for n, a in x.items() if n != "initial_state"}
    seg_P = shard(segment_ids)
    transition = functools.partial(chunk_transition, chunk_size=chunk_size)
    ms, bs = jax.vmap(transition)(**xs, segment_ids=seg_P)
    resets = jnp.concatenate([jnp.zeros((1, B), bool), seg_P[1:, :, 0] != seg_P[:-1, :, -1]])
    states = combine_transitions(ms, bs, initial_state=x["initial_state"], resets=resets)
    rule = functools.partial(gated_delta_rule, chunk_size=chunk_size, output_final_state=True)
    o_P, s_P = jax.vmap(rule)(**xs, segment_ids=seg_P, initial_state=states)
    o = jnp.moveaxis(o_P, 0, 1).reshape(w_o.shape)
    return jnp.sum(o * w_o) + jnp.sum(s_P[-1] * w_s), (o, s_P[-1])
  (_, (o, s)), dx = jax.value_and_grad(loss, has_aux=True)(x)
  return o, s, dx

@pytest.mark.parametrize("documents", [pytest.param(False, marks=pytest.mark.slow), True])
def test_context_parallel_state_passing(documents):
  seq_len = 200
  x = make_inputs(seq_len, a_max=1.0)
  w_o, w_s = weights(seq_len)
  pos = np.arange(seq_len)
  # Shards [0, 50), [50, 100), ...: a boundary inside shard 1, and ones at the edges of shards 2, 3.
  seg = np.stack([(pos >= 70).astype(np.int32) + (pos >= 150), (pos >= 100) + 0 * pos]).astype(np.int32)
  seg = seg if documents else np.zeros_like(seg)
  o, s, dx = run_and_grads(gated_delta_rule, x, w_o, w_s, seg)
  o_cp, s_cp, dx_cp = context_parallel(x, w_o, w_s, 4, 16, seg)
  assert max_err(o, o_cp) < 1e-5
  assert max_err(s, s_cp) < 1e-5
  for name in x:
    assert max_err(dx[name], dx_cp[name]) < 1e-5, name
