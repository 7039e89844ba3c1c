"""The kernel-backed grouped matmul: its custom_vjp (forward, input and weight gradients), masking of the rows a
kernel leaves unwritten, the fallback to xla, and backend selection. On CPU the kernels are `lax` references that
write NaN past the groups, as the Mosaic GPU kernels leave garbage there; on a Hopper GPU the real kernels are
checked against `lax.ragged_dot` too."""

import logging
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import relaymoe_jax as rm
from conftest import assert_close, mesh_of, random_layer
from relaymoe_jax.kernels import interface as gk, grouped_matmul as gm, mosaic_gpu as mg
from test_equivalence import BF16_RTOL, DATA_EXPERT, E_ONLY, F32_RTOL, assert_matches_oracle

GROUPS = {
    "random": [5, 17, 0, 30, 12, 0, 9, 23],
    "skewed": [0, 0, 0, 96, 0, 0, 0, 0],
    "empty_tail": [40, 0, 0, 0, 0, 0, 0, 0],  # 56 of 96 rows belong to no group
}


def _operands(seed, m=96, i=32, o=48, groups=8, dtype=jnp.float32):
  """lhs_MI, rhs_LIO (L = groups) and a cotangent c_MO."""
  rng = np.random.default_rng(seed)
  return (jnp.asarray(rng.normal(size=(m, i)), dtype),
          jnp.asarray(rng.normal(size=(groups, i, o)) / np.sqrt(i), dtype),
          jnp.asarray(rng.normal(size=(m, o)), jnp.float32))


def _loss_and_grads(gmm, lhs, rhs, sizes, c):
  def loss(lhs, rhs):
    out = gmm(lhs, rhs, sizes, preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST)
    return jnp.sum(out * c), out
  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(lhs, rhs)
  return out, grads


def _check_against_xla(backend, lhs, rhs, sizes, c, rtol):
  out_ref, (dl_ref, dr_ref) = _loss_and_grads(gm.get_backend("xla"), lhs, rhs, sizes, c)
  out, (dl, dr) = _loss_and_grads(gm.get_backend(backend), lhs, rhs, sizes, c)
  assert_close(out, out_ref, rtol, "out")
  assert_close(dl, dl_ref, rtol, "d lhs")
  assert_close(dr, dr_ref, rtol, "d rhs")
  rows = int(np.sum(sizes))
  assert not np.any(np.asarray(out[rows:])) and not np.any(np.asarray(dl[rows:]))  # zeros, as lax.ragged_dot


@pytest.mark.parametrize("groups", sorted(GROUPS))
def test_kernel_vjp_matches_ragged_dot(groups):
  lhs, rhs, c = _operands(1)
  _check_against_xla("kernel_reference", lhs, rhs, jnp.asarray(GROUPS[groups], jnp.int32), c, 1e-6)


def test_kernel_vjp_inside_shard_map_keeps_varying_types():
  """Inside shard_map with check_vma, rows varying over the mesh and weights invariant over 'data': the cotangent
  of the invariant weights is summed over 'data' (by JAX, outside the custom_vjp), exactly as for xla."""
  mesh = mesh_of((2, 4), DATA_EXPERT)
  lhs, rhs, c = _operands(2, m=8 * 96)
  sizes = jnp.asarray(GROUPS["random"], jnp.int32)

  def per_device(lhs, rhs, c, backend):
    out = gm.get_backend(backend)(lhs, rhs, sizes, preferred_element_type=jnp.float32,
                                  precision=jax.lax.Precision.HIGHEST)
    return jax.lax.psum(jnp.sum(out * c), DATA_EXPERT)

  def grads(backend):
    f = jax.shard_map(lambda a, b, cc: per_device(a, b, cc, backend), mesh=mesh,
                      in_specs=(P(DATA_EXPERT), P(rm.EXPERT), P(DATA_EXPERT)), out_specs=P(), check_vma=True)
    return jax.jit(jax.grad(f, argnums=(0, 1)))(lhs, jnp.tile(rhs, (4, 1, 1)), c)

  for a, b in zip(grads("kernel_reference"), grads("xla")):
    assert_close(a, b, 1e-6)


def test_unsupported_shape_falls_back_to_xla_with_a_logged_reason(caplog):
  lhs, rhs, c = _operands(3, i=33)  # the reference kernels refuse an odd contraction width
  gk.log_fallback.cache_clear()
  with caplog.at_level(logging.WARNING, logger=gk.__name__):
    _check_against_xla("kernel_reference", lhs, rhs, jnp.asarray(GROUPS["random"], jnp.int32), c, 1e-6)
  assert "kernel_reference falls back to xla: I=33 is odd" in caplog.text


def test_kernels_traced_for_a_gpu_mesh_elsewhere_see_its_sm_count(monkeypatch):
  """Compiling for GPUs this process lacks (a compile-only topology), the weight-gradient kernel's grid must come
  from the mesh's GPUs (132 SMs), not from this process's first device; nothing changes outside the kernel's trace
  or where this process's device is itself the GPU."""
  devices = jax.devices
  h200 = types.SimpleNamespace(abstract_device=types.SimpleNamespace(platform="gpu", num_cores=132))
  monkeypatch.setattr(jax.sharding, "get_abstract_mesh", lambda: h200)
  with mg._sm_count_of_target():
    first = jax.devices()[0]
    assert first.core_count == (devices()[0].core_count if devices()[0].platform == "gpu" else 132)
    assert first.platform == devices()[0].platform and len(jax.devices()) == len(devices())
  assert jax.devices is devices
  with pytest.raises(RuntimeError), mg._sm_count_of_target():
    raise RuntimeError
  assert jax.devices is devices
  monkeypatch.setattr(jax.sharding, "get_abstract_mesh", lambda: types.SimpleNamespace(abstract_device=None))
  with mg._sm_count_of_target():
    assert jax.devices is devices


def test_backend_selection():
  assert gm.resolve_backend("auto") == ("mosaic_gpu" if gm._hopper(jax.devices()[0]) else "xla")

  class CompileOnlyDevice:  # what `jax.experimental.topologies` gives: a kind, no compute capability
    platform, device_kind = "gpu", "NVIDIA H200"

  mesh = types.SimpleNamespace(devices=np.array([CompileOnlyDevice()]))
  assert gm.resolve_backend("auto", mesh) == "mosaic_gpu"  # the mesh's devices decide, not this process's
  CompileOnlyDevice.device_kind = "NVIDIA A100-SXM4-80GB"
  assert gm.resolve_backend("auto", mesh) == "xla"
  assert gm.resolve_backend("kernel_reference") == "kernel_reference"
  with pytest.raises(ValueError, match="backend 'cutlass'"):
    gm.resolve_backend("cutlass")


@pytest.mark.parametrize("dispatcher", ["ring_expert", "ring_token", "all_to_all"])
def test_dispatchers_on_the_kernel_path_match_the_oracle(dispatcher):
  layer = random_layer(21, 64, 16, 24, 16, 4, skew=dispatcher == "ring_token")
  assert_matches_oracle(layer, mesh_of((2, 4), DATA_EXPERT), F32_RTOL, dispatcher, backend="kernel_reference")


@pytest.mark.parametrize("dispatcher, options", [("ring_expert", {}), ("ring_token", {}),
                                                 ("ring_expert", {"keep_gate_up": True})])
def test_chunk_ladder_on_the_kernel_path_matches_the_oracle(dispatcher, options):
  """Chunks of three sizes, each with rows past the range's end that the kernels leave as NaN (kept, with
  `keep_gate_up`, nowhere)."""
  layer = random_layer(22, 64, 16, 24, 16, 4, skew=True)
  assert_matches_oracle(layer, mesh_of((2, 4), DATA_EXPERT), F32_RTOL, dispatcher, backend="kernel_reference",
                        chunk_rows=(24, 8, 3), **options)


def _hopper_or_skip():
  if not gm._hopper(jax.devices()[0]):
    pytest.skip("the Mosaic GPU kernels need a Hopper GPU; run `pytest -m gpu` there")


@pytest.mark.gpu
@pytest.mark.parametrize("groups", sorted(GROUPS))
def test_mosaic_gpu_matches_ragged_dot_on_hopper(groups):
  """bf16 inputs, outputs and all gradients against lax.ragged_dot computed in float32 on the same inputs."""
  _hopper_or_skip()
  g = len(GROUPS[groups])
  scale = 1024 // 96
  sizes = jnp.asarray([s * scale for s in GROUPS[groups]], jnp.int32)
  lhs, rhs, c = _operands(4, m=1024, i=256, o=384, groups=g, dtype=jnp.bfloat16)
  out_ref, (dl_ref, dr_ref) = _loss_and_grads(gm.get_backend("xla"), lhs.astype(jnp.float32),
                                              rhs.astype(jnp.float32), sizes, c)
  out, (dl, dr) = _loss_and_grads(gm.get_backend("mosaic_gpu"), lhs, rhs, sizes, c)
  for name, a, b in (("out", out, out_ref), ("d lhs", dl, dl_ref), ("d rhs", dr, dr_ref)):
    assert_close(a, b, 2e-2, name)
  assert not np.any(np.asarray(out[int(np.sum(sizes)):]))


@pytest.mark.gpu
@pytest.mark.parametrize("options", [{}, {"keep_gate_up": True}])
def test_expert_ring_on_mosaic_gpu_matches_the_oracle(options):
  """The expert ring of one on the Mosaic kernels (bf16; one chunk per hop, begun without zeros): output and every
  gradient against the float32 oracle on the same bf16 inputs."""
  _hopper_or_skip()
  layer = random_layer(23, 1024, 256, 128, 8, 2, skew=True, dtype=jnp.bfloat16)
  assert_matches_oracle(layer, mesh_of((1,), E_ONLY), BF16_RTOL, "ring_expert", backend="mosaic_gpu", **options)


@pytest.mark.parametrize("groups", sorted(GROUPS))
def test_scan_backend_matches_ragged_dot(groups):
  """`xla_scan` (the memory-faithful CPU backend of the memory benchmarks) computes the same values and gradients."""
  lhs, rhs, c = _operands(5)
  _check_against_xla("xla_scan", lhs, rhs, jnp.asarray(GROUPS[groups], jnp.int32), c, 1e-6)


def test_a_kernel_lowers_alike_however_many_kernels_the_process_lowered_before():
  """A kernel's hash is part of JAX's persistent-cache key of the program holding it: after `stable_kernel_hashes`
  (the trainer calls it) the same kernel lowered again for GPUs, after another one, hashes alike (jaxlib 0.11 hashes
  a process-wide count of lowered kernels into each otherwise, and a rerun never hit the cache)."""
  mg.stable_kernel_hashes()

  def kernel_hashes(out_width):
    args = (jax.ShapeDtypeStruct((1024, 256), jnp.bfloat16), jax.ShapeDtypeStruct((4, 256, out_width), jnp.bfloat16),
            jax.ShapeDtypeStruct((4,), jnp.int32))
    jax.clear_caches()
    text = jax.jit(mg.forward).trace(*args).lower(lowering_platforms=("cuda",)).as_text(debug_info=False)
    return re.findall(r'kernel_hash = "(.*?)", module', text)

  first = kernel_hashes(256)
  assert kernel_hashes(128) != first and kernel_hashes(256) == first and len(first) == 1
