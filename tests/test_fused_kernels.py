"""The fused expert kernels (`fused_kernels`, Pallas Triton) and the hop path on them (`fused_expert`).

On CPU the kernels run in Pallas's interpreter against their lax references (float32, max |a − b| / max |b| ≤
1e-5, on the rows the kernels write), and lower for NVIDIA GPUs at the Qwen3-30B layer's shape; the rings on the
fused path (its lax references) match the dense float32 oracle (1e-5) in outputs and every gradient. `pytest -m
gpu` runs the Triton kernels against the Mosaic GPU path on an H100/H200.
"""

import contextlib
import functools
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_close, mesh_of, random_layer
from relaymoe_jax import fused_expert, fused_kernels as fk, grouped_matmul as gm, testing as rmt
from test_equivalence import BF16_RTOL, DATA_EXPERT, E_ONLY, F32_RTOL, assert_matches_oracle

TILES = fk.Tiles(block_m=8, block_n=8, block_k=8)
TOKENS, D, F, ROWS = 24, 16, 16, 64
SIZES = (13, 0, 8, 19, 11)  # 51 of 64 rows: an empty group, groups ending mid-tile, rows past the last group


def _inputs(seed=0):
  k = jax.random.split(jax.random.key(seed), 7)
  groups = len(SIZES)
  return dict(
      x_TD=jax.random.normal(k[0], (TOKENS, D)), dy_TD=jax.random.normal(k[1], (TOKENS, D)),
      w_gate_up_LDU=jax.random.normal(k[2], (groups, D, 2 * F)) / 4,
      w_down_LFD=jax.random.normal(k[3], (groups, F, D)) / 4,
      tok_M=jax.random.randint(k[4], (ROWS,), 0, TOKENS), weight_M=jax.random.uniform(k[5], (ROWS,)),
      gate_up_MU=jax.random.normal(k[6], (ROWS, 2 * F)), sizes_L=jnp.array(SIZES, jnp.int32))


def _calls(a):
  """(kernel, reference) calls of each kernel on the same inputs."""
  return {
      "gate_up_swiglu": lambda f, **o: f(a["x_TD"], a["tok_M"], a["w_gate_up_LDU"], a["sizes_L"],
                                         outputs=("h", "gate_up"), **o),
      "down_grad": lambda f, **o: f(a["dy_TD"], a["tok_M"], a["w_down_LFD"], a["gate_up_MU"], a["weight_M"],
                                    a["sizes_L"], **o),
      "weight_grad_of_gathered_lhs": lambda f, **o: f(a["x_TD"], a["gate_up_MU"], a["sizes_L"], a_tok_M=a["tok_M"],
                                                      **o),
      "weight_grad_of_gathered_rhs": lambda f, **o: f(a["gate_up_MU"], a["dy_TD"], a["sizes_L"], b_tok_M=a["tok_M"],
                                                      **o),
  }


KERNELS = {"gate_up_swiglu": (fk.gate_up_swiglu, fk.reference_gate_up_swiglu),
           "down_grad": (fk.down_grad, fk.reference_down_grad),
           "weight_grad_of_gathered_lhs": (fk.weight_grad, fk.reference_weight_grad),
           "weight_grad_of_gathered_rhs": (fk.weight_grad, fk.reference_weight_grad)}


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_kernels_in_the_interpreter_match_their_lax_references(name):
  """Every output on the rows of a group (the rest may hold anything); a weight gradient's empty group is zero."""
  kernel, reference = KERNELS[name]
  call = _calls(_inputs())[name]
  got = call(kernel, tiles=TILES, interpret=True)
  want = call(reference)
  valid = sum(SIZES)
  for i, (g, w) in enumerate(zip(*(jax.tree.leaves(v) for v in (got, want)))):
    if name.startswith("weight_grad"):
      assert_close(g, w, F32_RTOL, f"{name} output {i}")
      assert not np.any(np.asarray(g[SIZES.index(0)])), "an empty group's gradient is zero"
    else:
      assert_close(g[:valid], w[:valid], F32_RTOL, f"{name} output {i}")


def test_the_references_compute_swiglu_and_its_gradients():
  """The lax references against jax.grad of one expert's weighted SwiGLU row by row (the contract the kernels are
  checked against above)."""
  a = _inputs(1)
  group_M = np.repeat(np.arange(len(SIZES)), SIZES)
  n = len(group_M)
  x_MD, dy_MD = a["x_TD"][a["tok_M"][:n]], a["dy_TD"][a["tok_M"][:n]]
  w_gu, w_down, weight = a["w_gate_up_LDU"][group_M], a["w_down_LFD"][group_M], a["weight_M"][:n]

  def rows_loss(x_MD, w_gu, w_down, weight):
    gate_up = jnp.einsum("md,mdu->mu", x_MD, w_gu, precision="highest")
    h = jax.nn.silu(gate_up[:, :F]) * gate_up[:, F:]
    y = jnp.einsum("mf,mfd->md", h, w_down, precision="highest") * weight[:, None]
    return jnp.sum(y * dy_MD), gate_up

  (_, gate_up), grads = jax.value_and_grad(rows_loss, argnums=(0, 1, 2, 3), has_aux=True)(x_MD, w_gu, w_down, weight)
  d_gate_up, hw, dw = fk.reference_down_grad(a["dy_TD"], a["tok_M"], a["w_down_LFD"],
                                             jnp.pad(gate_up, ((0, ROWS - n), (0, 0))), a["weight_M"], a["sizes_L"])
  assert_close(dw[:n], grads[3], F32_RTOL, "router weight")
  assert_close(jnp.einsum("mu,mdu->md", d_gate_up[:n], w_gu, precision="highest"), grads[0], F32_RTOL, "x")
  d_w_down = fk.reference_weight_grad(hw, a["dy_TD"], a["sizes_L"], b_tok_M=a["tok_M"])
  d_w_gate_up = fk.reference_weight_grad(a["x_TD"], jnp.pad(d_gate_up[:n], ((0, ROWS - n), (0, 0))), a["sizes_L"],
                                         a_tok_M=a["tok_M"])
  for l in range(len(SIZES)):
    rows = group_M == l
    assert_close(d_w_down[l], grads[2][rows].sum(0), F32_RTOL, f"W_down[{l}]")
    assert_close(d_w_gate_up[l], grads[1][rows].sum(0), F32_RTOL, f"W_gate_up[{l}]")


@pytest.mark.parametrize("seed", range(4))
def test_group_visits_cover_each_grouped_row_once_with_its_group(seed):
  rng = np.random.default_rng(seed)
  sizes = rng.integers(0, 20, size=7) * rng.integers(0, 2, size=7)
  rows, block_m = 128, 16
  v = jax.tree.map(np.asarray, fk.group_visits(jnp.array(sizes, jnp.int32), rows, block_m))
  seen = np.zeros(rows, int)
  group_of_row = np.repeat(np.arange(len(sizes)), sizes)
  for tile, group, lo, hi in zip(*v):
    if lo < hi:
      assert tile * block_m <= lo < hi <= (tile + 1) * block_m
      assert np.all(group_of_row[lo:hi] == group)
      seen[lo:hi] += 1
  assert np.all(seen[:sizes.sum()] == 1) and not np.any(seen[sizes.sum():])


def test_the_kernels_lower_for_nvidia_gpus_at_the_qwen3_layer_shape():
  """Each kernel traces and lowers to one Triton call (Pallas's Triton lowering, on this host, for an abstract
  H200: JAX 0.11 asks which GPU), bf16, the default tiles, 16 experts of the Qwen3-30B layer (D 2048, F 768) and
  8192 rows."""
  s = jax.ShapeDtypeStruct
  bf16, i32 = jnp.bfloat16, jnp.int32
  tokens, width, ffn, groups, rows = 4096, 2048, 768, 16, 8192
  assert fk.TRITON.unsupported(rows, width, ffn, bf16) is None
  assert fk.TRITON.unsupported(rows, width, ffn, jnp.float32) == (
      "dtype float32 (these kernels take bfloat16 or float16)")
  assert fk.TRITON.unsupported(rows, width, 700, bf16) == "F=700 is not a multiple of 64"
  tok, sizes = s((rows,), i32), s((groups,), i32)
  cases = [
      (functools.partial(fk.gate_up_swiglu, outputs=("h", "gate_up")),
       (s((tokens, width), bf16), tok, s((groups, width, 2 * ffn), bf16), sizes)),
      (fk.down_grad, (s((tokens, width), bf16), tok, s((groups, ffn, width), bf16), s((rows, 2 * ffn), bf16),
                      s((rows,), jnp.float32), sizes)),
      (fk.weight_grad, (s((tokens, width), bf16), s((rows, 2 * ffn), bf16), sizes, tok)),
      (lambda a, b, sz, t: fk.weight_grad(a, b, sz, None, t), (s((rows, ffn), bf16), s((tokens, width), bf16), sizes,
                                                                 tok)),
  ]
  h200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
  for f, args in cases:
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=h200)):
      text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert len(re.findall(r"custom_call @__gpu\$xla\.gpu\.triton", text)) == 1, text[:2000]


def _count_fused_chunks(monkeypatch):
  calls = []
  for name in ("expert_swiglu", "expert_swiglu_backward"):
    original = getattr(fused_expert, name)
    monkeypatch.setattr(fused_expert, name, functools.partial(lambda f, n, *a, **k: calls.append(n) or f(*a, **k),
                                                              original, name))
  return calls


@pytest.mark.parametrize("dispatcher, options", [
    ("ring_expert", {}),
    pytest.param("ring_token", {}, marks=pytest.mark.slow),  # 3-5 s each on 2 cores; CI's second step runs them
    pytest.param("ring_expert", {"keep_gate_up": True}, marks=pytest.mark.slow)])
def test_rings_on_the_fused_path_match_the_oracle(dispatcher, options, monkeypatch, caplog):
  """Chunks of 16 and 8 rows run the fused path (rows read by token index); chunks of 3, which its tiles do not
  divide, gather their rows and run the plain kernels, with a warning (once per process and reason)."""
  fused_expert._log_fallback.cache_clear()
  calls = _count_fused_chunks(monkeypatch)
  layer = random_layer(23, 64, 16, 24, 16, 4, skew=True)
  with caplog.at_level(logging.WARNING, logger=fused_expert.__name__):
    assert_matches_oracle(layer, mesh_of((2, 4), DATA_EXPERT), F32_RTOL, dispatcher, backend="fused_reference",
                          chunk_rows=(16, 8, 3), **options)
  assert {"expert_swiglu", "expert_swiglu_backward"} <= set(calls)
  assert "rows=3 is not a multiple of 8" in caplog.text


@contextlib.contextmanager
def _kernel_set(monkeypatch, name, **changes):
  """fk.<name> with `changes` for the block. The oracle check's jitted function is shared across tests by its
  static arguments, so it is traced afresh inside the block and after it."""
  rmt._values_and_grads.clear_cache()
  with monkeypatch.context() as patch:
    patch.setattr(fk, name, getattr(fk, name)._replace(**changes))
    yield
  rmt._values_and_grads.clear_cache()


def test_kernels_that_lose_in_the_backward_leave_it_to_the_plain_path(monkeypatch):
  """Kernels whose backward is slower than the plain path's (Triton's, `KernelSet.backward`) fuse the forward's
  gate/up only: the backward gathers its rows and runs the plain grouped matmuls, with the same gradients."""
  calls = _count_fused_chunks(monkeypatch)
  layer = random_layer(27, 64, 16, 24, 16, 4, skew=True)
  with _kernel_set(monkeypatch, "REFERENCE", backward=False):
    assert_matches_oracle(layer, mesh_of((2, 4), DATA_EXPERT), F32_RTOL, "ring_expert", backend="fused_reference",
                          chunk_rows=(16, 8))
  assert "expert_swiglu" in calls and "expert_swiglu_backward" not in calls, calls


def test_the_fused_path_needs_the_recomputing_backward():
  layer = random_layer(24, 16, 16, 24, 8, 2)
  with pytest.raises(ValueError, match="backend='fused_reference' needs recompute=True"):
    assert_matches_oracle(layer, mesh_of((2,), E_ONLY), F32_RTOL, "ring_expert", backend="fused_reference",
                          recompute=False)


def test_fused_backends_are_named_and_others_run_their_plain_matmuls():
  assert gm.resolve_backend("fused_triton") == "fused_triton"
  assert gm.get_backend("fused_reference") is gm.BACKENDS["kernel_reference"]
  assert gm.max_chunk_rows("fused_triton", 16, 768) is None


def _hopper_or_skip():
  if not gm._hopper(jax.devices()[0]):
    pytest.skip("the fused Triton kernels are measured on a Hopper GPU; run `pytest -m gpu` there")


@pytest.mark.gpu
@pytest.mark.parametrize("options", [{}, {"keep_gate_up": True}])
def test_fused_triton_matches_the_oracle_on_a_gpu(options, monkeypatch):
  """bf16 on the ring of one (every expert on the GPU): one chunk of 1024 rows in 128-row tiles, on the fused path
  (its forward's gate/up; the backward too where `TRITON.backward` says the kernels win there)."""
  _hopper_or_skip()
  calls = _count_fused_chunks(monkeypatch)
  layer = random_layer(25, 512, 256, 128, 8, 2, dtype=jnp.bfloat16)
  assert_matches_oracle(layer, mesh_of((1,), E_ONLY), BF16_RTOL, "ring_expert", backend="fused_triton", **options)
  assert "expert_swiglu" in calls and ("expert_swiglu_backward" in calls) == fk.TRITON.backward, calls

  with _kernel_set(monkeypatch, "TRITON", backward=True):  # the backward kernels, which the hop leaves out
    assert_matches_oracle(layer, mesh_of((1,), E_ONLY), BF16_RTOL, "ring_expert", backend="fused_triton",
                          **options)
  assert "expert_swiglu_backward" in calls


def test_bfloat16_on_the_fused_path_matches_the_oracle():
  """bf16 inputs (dy reaches the hop in float32 and is rounded as the plain path rounds it), 3e-2 against the
  float32 oracle on the same bf16-rounded inputs."""
  layer = random_layer(26, 64, 16, 24, 16, 4, skew=True, dtype=jnp.bfloat16)
  assert_matches_oracle(layer, mesh_of((2,), E_ONLY), BF16_RTOL, "ring_expert", backend="fused_reference",
                        chunk_rows=(32, 8))
