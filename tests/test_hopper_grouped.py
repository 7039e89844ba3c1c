"""SwiGLU in the gate/up kernel's epilogue (its custom_vjp, keep, fallback), and the
warp-specialized Hopper kernels: on CPU in Pallas's GPU interpreter (rhs read transposed is not interpretable, nor
the weight gradient, which reads its lhs transposed: only its block plan runs on CPU), on a Hopper GPU under
`pytest -m gpu`, each against `lax.ragged_dot` or per-group products in float32 on the same inputs."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

from conftest import assert_close, mesh_of, random_layer
from relaymoe_jax import activations
from relaymoe_jax.kernels import grouped_matmul as gm, hopper_grouped as hg, hopper_weight_grad as hw
from test_equivalence import BF16_RTOL, DATA_EXPERT, E_ONLY, F32_RTOL, assert_matches_oracle

# Rows 0–39 in group 0, group 1 empty, 40–89 in group 2; rows 90–99 in none (left unwritten by the kernel).
SIZES = [40, 0, 50]
BF16_KERNEL_RTOL = 1e-2  # bf16 outputs of float32 accumulations over ≤ 256 products


def _ragged_f32(lhs, rhs, sizes):
  return jax.lax.ragged_dot(lhs.astype(jnp.float32), rhs.astype(jnp.float32), sizes,
                            precision=jax.lax.Precision.HIGHEST)


def _operands(seed, m, k, n, groups):
  rng = np.random.default_rng(seed)
  return (jnp.asarray(rng.normal(size=(m, k)), jnp.bfloat16),
          jnp.asarray(rng.normal(size=(groups, k, n)) / np.sqrt(k), jnp.bfloat16))


def _check_kernel(lhs, rhs, sizes, rows, **kernel_options):
  """Plain, and SwiGLU (h, and gate|up kept), against float32 references on the rows in groups."""
  expected = _ragged_f32(lhs, rhs, sizes)
  out = hg.grouped_matmul(lhs, rhs, sizes, **kernel_options)
  assert_close(out[:rows], expected[:rows], BF16_KERNEL_RTOL, "plain")
  h, kept = hg.grouped_matmul(lhs, rhs, sizes, swiglu=True, keep=True, **kernel_options)
  assert_close(kept[:rows], expected[:rows], BF16_KERNEL_RTOL, "gate|up kept")
  assert_close(h[:rows], activations.apply(expected, "swiglu", jnp.float32)[:rows], BF16_KERNEL_RTOL, "h")
  h_only = hg.grouped_matmul(lhs, rhs, sizes, swiglu=True, **kernel_options)
  np.testing.assert_array_equal(h_only[:rows], h[:rows])


@pytest.mark.slow  # ~20 s on 2 cores; the default run reached 10.3 min on CI's 2 cores; CI's second step runs it
def test_kernel_in_the_gpu_interpreter_matches_ragged_dot():
  """Tiles of 32 rows: group 0 ends inside tile 1, which group 2 shares (two visits storing their own rows); the
  empty group has no visit; the last tile is partly past M's end."""
  lhs, rhs = _operands(0, 100, 64, 64, 3)
  tiles = hg.Tiles(tile_m=32, tile_n=16, tile_k=32, stages=2)
  _check_kernel(lhs, rhs, jnp.asarray(SIZES, jnp.int32), sum(SIZES), tiles=tiles, num_sms=3,
                interpret=InterpretGPUParams())


def test_visits_cover_each_group_row_once():
  sizes = jnp.asarray([40, 0, 50, 0, 7], jnp.int32)
  tile_V, group_V, lo_V, hi_V = (np.asarray(a) for a in hg.group_visits(sizes, 100, 32))
  covered = np.full(100, -1)
  for t, g, lo, hi in zip(tile_V, group_V, lo_V, hi_V):
    assert t * 32 <= lo <= hi <= (t + 1) * 32
    assert np.all(covered[lo:hi] == -1)
    covered[lo:hi] = g
  np.testing.assert_array_equal(covered, [0] * 40 + [2] * 50 + [4] * 7 + [-1] * 3)


# Weight-gradient groups in 64-row blocks: empty first, a boundary inside a block, a group inside one block, an
# empty one between, and an empty one last.
WGRAD_SIZES = [0, 70, 20, 0, 28, 0]


def test_weight_grad_blocks_cover_each_group_from_its_first_block():
  start, end, first, count = (np.asarray(a) for a in hw.group_blocks(jnp.asarray(WGRAD_SIZES, jnp.int32), 64))
  np.testing.assert_array_equal(start, [0, 0, 70, 90, 90, 118])
  np.testing.assert_array_equal(end, [0, 70, 90, 90, 118, 118])
  np.testing.assert_array_equal(first, [0, 0, 64, 0, 64, 0])  # an empty group reads block 0, all rows masked
  np.testing.assert_array_equal(count, [1, 2, 1, 1, 1, 1])


def _swiglu_loss_and_grads(backend, x, w, sizes, c):
  def loss(x, w):
    h, _ = gm.SWIGLU_BACKENDS[backend](x, w, sizes, False) if backend in gm.SWIGLU_BACKENDS else (None, None)
    return jnp.sum(h.astype(jnp.float32) * c), h
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, w)


def test_swiglu_kernel_path_matches_the_unfused_one_with_gradients():
  """On the reference kernels (NaN past the groups, as the GPU kernel leaves garbage): h zero past the groups,
  h and its gradients (through the custom_vjp: SwiGLU's derivative, then the plain kernels' gradients) against
  gate/up then SwiGLU in float32 autodiff; `keep` returns gate|up too."""
  rng = np.random.default_rng(3)
  sizes = jnp.asarray(SIZES, jnp.int32)
  x = jnp.asarray(rng.normal(size=(100, 16)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(3, 16, 256)) / 4, jnp.float32)
  c = jnp.asarray(rng.normal(size=(100, 128)), jnp.float32)
  (_, h), grads = _swiglu_loss_and_grads("kernel_reference", x, w, sizes, c)

  def unfused(x, w):
    gate_up_MU = jax.lax.ragged_dot(x, w, sizes, precision=jax.lax.Precision.HIGHEST)
    h_MF = activations.apply(gate_up_MU, "swiglu", jnp.float32)
    return jnp.sum(h_MF * c), h_MF

  (_, h_ref), grads_ref = jax.value_and_grad(unfused, argnums=(0, 1), has_aux=True)(x, w)
  assert_close(h, h_ref, 1e-6, "h")
  assert not np.any(np.asarray(h[sum(SIZES):]))
  for name, a, b in zip(("dx", "dw"), grads, grads_ref):
    assert_close(a, b, 1e-6, name)
  h_kept, kept = gm.SWIGLU_BACKENDS["kernel_reference"](x, w, sizes, True)
  assert_close(h_kept, h_ref, 1e-6, "h, kept")
  assert_close(kept[:sum(SIZES)], jax.lax.ragged_dot(x, w, sizes, precision=jax.lax.Precision.HIGHEST)[:90], 1e-6)


def test_swiglu_kernel_falls_back_with_a_logged_reason(caplog):
  x, w = jnp.ones((8, 6)), jnp.ones((2, 6, 8))  # D = 6: the reference's stand-in constraint refuses it
  with caplog.at_level(logging.WARNING):
    assert gm.SWIGLU_BACKENDS["kernel_reference"](x, w, jnp.asarray([4, 4], jnp.int32), False) is None
    y, kept = gm.expert_mlp(x, w, jnp.ones((2, 4, 6)), jnp.asarray([4, 4], jnp.int32), backend="kernel_reference")
  assert "kernel_reference's fused gate/up kernel does not apply (D=6 is not a multiple of 4)" in caplog.text
  assert kept is None and y.shape == (8, 6)


@pytest.mark.parametrize("dispatcher, options", [("ring_expert", {}), ("ring_expert", {"keep_gate_up": True}),
                                                 ("all_to_all", {})])
def test_dispatchers_on_the_swiglu_kernel_path_match_the_oracle(dispatcher, options):
  """Through the SwiGLU kernel's path (forward; the all-to-all's autodiff through its custom_vjp) and the rings'
  recomputing backward."""
  layer = random_layer(24, 32, 16, 128, 8, 2)
  assert_matches_oracle(layer, mesh_of((2, 4), DATA_EXPERT), F32_RTOL, dispatcher, backend="kernel_reference",
                        **options)


def _hopper_or_skip():
  if not gm._hopper(jax.devices()[0]):
    pytest.skip("the Mosaic GPU kernels need a Hopper GPU; run `pytest -m gpu` there")


@pytest.mark.gpu
def test_kernel_on_hopper_matches_ragged_dot():
  """The default tiles at `MIN_ROWS` rows (where `mosaic_gpu` runs them): plain, rhs read transposed, SwiGLU and
  gate|up kept; a group boundary inside a tile, an empty group, rows past the groups."""
  _hopper_or_skip()
  m = hg.MIN_ROWS
  sizes = jnp.asarray([m // 3 + 5, 0, m // 2, m // 8], jnp.int32)
  rows = int(jnp.sum(sizes))
  lhs, rhs = _operands(1, m, 256, 512, 4)
  _check_kernel(lhs, rhs, sizes, rows)
  d_out = jnp.asarray(np.random.default_rng(2).normal(size=(m, 512)), jnp.bfloat16)
  transposed = hg.grouped_matmul(d_out, rhs, sizes, transpose_rhs=True)
  assert_close(transposed[:rows], _ragged_f32(d_out, jnp.swapaxes(rhs, 1, 2), sizes)[:rows], BF16_KERNEL_RTOL,
               "transposed")


@pytest.mark.gpu
def test_weight_grad_on_hopper_matches_the_per_group_products():
  """Every group of `WGRAD_SIZES` (scaled) against lhsᵀ·d_out of its rows in float32; empty groups exactly zero;
  NaN in the lhs rows past the groups never reaches a product (the last group's block holds them)."""
  _hopper_or_skip()
  scale = 64
  sizes = np.asarray(WGRAD_SIZES) * scale + np.asarray([0, 3, -5, 0, 7, 0])
  m = -(-(int(sizes.sum()) + 1) // 64) * 64  # the last group ends inside a block, NaN after it
  rng = np.random.default_rng(4)
  lhs = jnp.asarray(rng.normal(size=(m, 256)), jnp.bfloat16).at[int(sizes.sum()):].set(jnp.nan)
  d_out = jnp.asarray(rng.normal(size=(m, 512)), jnp.bfloat16)
  out = np.asarray(hw.weight_grad(lhs, d_out, jnp.asarray(sizes, jnp.int32)), np.float32)
  ends = np.cumsum(sizes)
  for group, (start, end) in enumerate(zip(ends - sizes, ends)):
    a, b = (np.asarray(v[start:end], np.float32) for v in (lhs, d_out))
    if start == end:
      np.testing.assert_array_equal(out[group], 0)
    else:
      assert_close(out[group], a.T @ b, BF16_KERNEL_RTOL, f"group {group}")


@pytest.mark.gpu
@pytest.mark.parametrize("options", [{}, {"keep_gate_up": True}])
def test_expert_ring_of_one_on_hopper_kernels_matches_the_oracle(options):
  """The ring of one at `MIN_ROWS` pairs, so every grouped matmul runs on these kernels (weight gradients on
  `hopper_weight_grad`): output and every gradient against the float32 oracle on the same bf16 inputs."""
  _hopper_or_skip()
  layer = random_layer(25, hg.MIN_ROWS // 2, 256, 128, 8, 2, dtype=jnp.bfloat16)
  assert_matches_oracle(layer, mesh_of((1,), E_ONLY), BF16_RTOL, "ring_expert", backend="mosaic_gpu", **options)
