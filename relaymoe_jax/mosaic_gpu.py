"""JAX's Hopper grouped-matmul kernels (Pallas Mosaic GPU) as a `GroupedKernels` set, with per-shape tiles.

No communication. forward = `ragged_dot_mgpu.ragged_dot`; input gradient = the same kernel with
`transpose_rhs=True` (the weights are read transposed in shared memory, never copied); weight gradient =
`transposed_ragged_dot_mgpu.transposed_ragged_dot`. Their constraints (checked in `unsupported`, which sends other
shapes to `xla`): bf16/f16 inputs, the contraction dim of `ragged_dot` a multiple of block_k, output dims a
multiple of the output tile, and shared memory ≤ 228 kB per SM. Tiles come from `mosaic_gpu_tiles.json` (keyed by
op and K×N, written by `python -m benchmarks.grouped_gemm --tune`), else the defaults below, shrunk to divide the
shape. Importing this module needs a JAX with Pallas Mosaic GPU; tracing its kernels needs a Hopper GPU, or (compiling
for GPUs this process does not have, e.g. `relaymoe-plan --topology`) a mesh of them around the call.
"""

import contextlib
import functools
import json
import pathlib

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu

from relaymoe_jax.grouped_matmul import GroupedKernels

TILES_FILE = pathlib.Path(__file__).with_name("mosaic_gpu_tiles.json")
RAGGED, TRANSPOSED = "ragged_dot", "transposed_ragged_dot"
# Measured on H200 (DESIGN.md): 310 TFLOP/s forward at M32768 K2048 N768 G16 with 192×128×64, 4 stages, 2 N blocks.
DEFAULT_TILES = {
    RAGGED: dict(block_m=192, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=2),
    TRANSPOSED: dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=2),
}
SHARED_MEMORY_BYTES = 228_000
SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@functools.lru_cache(maxsize=1)
def tuned_tiles():
  return json.loads(TILES_FILE.read_text()) if TILES_FILE.exists() else {}


def _fits(op, t, k, n, itemsize=2):
  """Whether tiles t divide a (·, k) × (k, n) product for `op` and fit shared memory."""
  smem = (t["block_m"] * t["block_k"] + t["block_k"] * t["block_n"]) * t["max_concurrent_steps"] * itemsize
  if smem > SHARED_MEMORY_BYTES:
    return False
  if op == RAGGED:
    return k % t["block_k"] == 0 and n % (t["block_n"] * t["grid_block_n"]) == 0
  return k % t["block_m"] == 0 and n % t["block_n"] == 0  # transposed: output [G, k, n]


def tiles_for(op, k, n):
  """Tiles for `op` producing a k×n (transposed) or ·×n (ragged, contracting k) result, or None if none fit."""
  candidates = [tuned_tiles().get(op, {}).get(f"{k}x{n}"), DEFAULT_TILES[op]]
  for base in filter(None, candidates):
    for grid_block_n in (base["grid_block_n"], 1):
      for block_n in (base["block_n"], 128, 64):
        for block_m in (base["block_m"], 128, 64):
          t = dict(base, grid_block_n=grid_block_n, block_n=block_n, block_m=block_m)
          if _fits(op, t, k, n):
            return t
  return None


def unsupported(m, k, n, dtype):
  if dtype not in SUPPORTED_DTYPES:
    return f"dtype {dtype} (the Mosaic kernels take bfloat16 or float16)"
  needs = {"forward": (RAGGED, k, n), "input gradient": (RAGGED, n, k), "weight gradient": (TRANSPOSED, k, n)}
  for what, (op, kk, nn) in needs.items():
    if tiles_for(op, kk, nn) is None:
      return f"no {op} tiles divide the {what} of K={k}, N={n}"
  return None


def forward(lhs_MK, rhs_GKN, sizes_G):
  return ragged_dot_mgpu.ragged_dot(lhs_MK, rhs_GKN, group_sizes=sizes_G,
                                    **tiles_for(RAGGED, lhs_MK.shape[1], rhs_GKN.shape[2]))


def lhs_grad(d_out_MN, rhs_GKN, sizes_G):
  # rhs [G, K, N] read as [G, n=K, k=N] with transpose_rhs: d_out @ rhs[g]ᵀ with no transposed copy.
  return ragged_dot_mgpu.ragged_dot(d_out_MN, rhs_GKN, group_sizes=sizes_G, transpose_rhs=True,
                                    **tiles_for(RAGGED, d_out_MN.shape[1], rhs_GKN.shape[1]))


class _WithCores:
  """A device that reports another core count."""

  def __init__(self, device, core_count):
    self._device, self.core_count = device, core_count

  def __getattr__(self, name):
    return getattr(self._device, name)


@contextlib.contextmanager
def _sm_count_of_target():
  """`transposed_ragged_dot` sizes its persistent grid from `jax.devices()[0].core_count`. Compiling for GPUs this
  process does not have (a compile-only topology), that device is this process's CPU: while the kernel traces, it
  reports the SMs of the mesh's GPUs instead (nothing else changes; not thread-safe: another thread asking
  `jax.devices()` meanwhile would see the same)."""
  devices, target = jax.devices, jax.sharding.get_abstract_mesh().abstract_device
  if devices()[0].platform == "gpu" or getattr(target, "platform", None) != "gpu":
    yield
    return
  jax.devices = lambda *args, **kwargs: [_WithCores(d, target.num_cores) for d in devices(*args, **kwargs)]
  try:
    yield
  finally:
    jax.devices = devices


def rhs_grad(lhs_MK, d_out_MN, sizes_G):
  # The kernel's dynamic grid mixes int32 and int64.
  with jax.numpy_dtype_promotion("standard"), _sm_count_of_target():
    return transposed_ragged_dot_mgpu.transposed_ragged_dot(
        lhs_MK, d_out_MN, group_sizes=sizes_G, **tiles_for(TRANSPOSED, lhs_MK.shape[1], d_out_MN.shape[1]))


KERNELS = GroupedKernels(name="mosaic_gpu", forward=forward, lhs_grad=lhs_grad, rhs_grad=rhs_grad,
                         unsupported=unsupported)
