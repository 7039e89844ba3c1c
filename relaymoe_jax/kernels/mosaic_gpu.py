"""Hopper grouped-matmul kernels (Pallas Mosaic GPU) as a `GroupedKernels` set: ours (`hopper_grouped`) and JAX's,
with per-shape tiles for JAX's.

No communication. forward = `hopper_grouped`'s kernel from `hopper_grouped.MIN_ROWS` rows, else JAX's
`ragged_dot_mgpu.ragged_dot`; input gradient = the same kernels reading the weights transposed in shared memory
(never copied); weight gradient = `hopper_weight_grad` from its `MIN_ROWS` rows, else JAX's
`transposed_ragged_dot_mgpu.transposed_ragged_dot`; SwiGLU fused into the gate/up product =
`hopper_grouped.gate_up_swiglu`. JAX's kernels' constraints (checked in `unsupported`, which
sends other shapes to `xla`): bf16/f16 inputs, the contraction width I of `ragged_dot` a multiple of block_k,
output widths a multiple of the output tile, and shared memory ≤ 228 kB per SM. Their tiles come from
`mosaic_gpu_tiles.json` (keyed by op and I×O, written by `python -m benchmarks.grouped_gemm --tune`), else the
defaults below, shrunk to divide the shape. Importing this module needs a JAX with Pallas Mosaic GPU (the CPU
jaxlib has it too, so `grouped_matmul` imports it everywhere); tracing its kernels needs a Hopper GPU, or
(compiling for GPUs this process does not have, e.g. `relaymoe-plan --topology`) a mesh of them around the call.
Shape letters: see relaymoe_jax.
"""

import contextlib
import functools
import json
import pathlib

import jax
import jax.numpy as jnp
from jax._src.lib.mlir import ir
from jax.experimental.mosaic.gpu import dialect as mosaic_dialect
from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu

from relaymoe_jax.kernels import hopper_grouped, hopper_weight_grad
from relaymoe_jax.kernels.interface import GroupedKernels

TILES_FILE = pathlib.Path(__file__).with_name("mosaic_gpu_tiles.json")
RAGGED, TRANSPOSED = "ragged_dot", "transposed_ragged_dot"
# The forward's defaults are the fastest tiles of the H200 measurement in docs/design.md: 310 TFLOP/s for 32768
# rows, 16 groups, contraction width 2048 and output width 768, with 192×128×64 (m×n×k) tiles in 4 stages (2 blocks
# along the output width).
DEFAULT_TILES = {
    RAGGED: dict(block_m=192, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=2),
    TRANSPOSED: dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=2),
}
SHARED_MEMORY_BYTES = 228_000
SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@functools.lru_cache(maxsize=1)
def tuned_tiles():
  return json.loads(TILES_FILE.read_text()) if TILES_FILE.exists() else {}


def _fits(op, t, i, o, itemsize=2):
  """Whether tiles t divide a (·, i) × (i, o) product for `op` and fit shared memory."""
  smem = (t["block_m"] * t["block_k"] + t["block_k"] * t["block_n"]) * t["max_concurrent_steps"] * itemsize
  if smem > SHARED_MEMORY_BYTES:
    return False
  if op == RAGGED:
    return i % t["block_k"] == 0 and o % (t["block_n"] * t["grid_block_n"]) == 0
  return i % t["block_m"] == 0 and o % t["block_n"] == 0  # transposed: output [L, i, o]


def tiles_for(op, i, o):
  """Tiles for `op` producing an i×o (transposed) or ·×o (ragged, contracting i) result, or None if none fit."""
  candidates = [tuned_tiles().get(op, {}).get(f"{i}x{o}"), DEFAULT_TILES[op]]
  for base in filter(None, candidates):
    for grid_block_n in (base["grid_block_n"], 1):
      for block_n in (base["block_n"], 128, 64):
        for block_m in (base["block_m"], 128, 64):
          t = dict(base, grid_block_n=grid_block_n, block_n=block_n, block_m=block_m)
          if _fits(op, t, i, o):
            return t
  return None


def unsupported(m, i, o, dtype):
  if dtype not in SUPPORTED_DTYPES:
    return f"dtype {dtype} (the Mosaic kernels take bfloat16 or float16)"
  needs = {"forward": (RAGGED, i, o), "input gradient": (RAGGED, o, i), "weight gradient": (TRANSPOSED, i, o)}
  for what, (op, width_in, width_out) in needs.items():
    if tiles_for(op, width_in, width_out) is None:
      return f"no {op} tiles divide the {what} of I={i}, O={o}"
  return None


def forward(lhs_MI, rhs_LIO, sizes_L):
  (m, i), o = lhs_MI.shape, rhs_LIO.shape[2]
  if hopper_grouped.takes(m, i, o, lhs_MI.dtype):
    return hopper_grouped.forward(lhs_MI, rhs_LIO, sizes_L)
  return ragged_dot_mgpu.ragged_dot(lhs_MI, rhs_LIO, group_sizes=sizes_L,
                                    **tiles_for(RAGGED, lhs_MI.shape[1], rhs_LIO.shape[2]))


def lhs_grad(d_out_MO, rhs_LIO, sizes_L):
  (m, o), i = d_out_MO.shape, rhs_LIO.shape[1]
  if hopper_grouped.takes(m, o, i, d_out_MO.dtype):
    return hopper_grouped.lhs_grad(d_out_MO, rhs_LIO, sizes_L)
  # rhs [L, I, O] read as [L, n=I, k=O] with transpose_rhs: d_out @ rhs[l]ᵀ with no transposed copy.
  return ragged_dot_mgpu.ragged_dot(d_out_MO, rhs_LIO, group_sizes=sizes_L, transpose_rhs=True,
                                    **tiles_for(RAGGED, d_out_MO.shape[1], rhs_LIO.shape[1]))


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


def rhs_grad(lhs_MI, d_out_MO, sizes_L):
  (m, i), o = lhs_MI.shape, d_out_MO.shape[1]
  if hopper_weight_grad.takes(m, i, o, lhs_MI.dtype):
    return hopper_weight_grad.weight_grad(lhs_MI, d_out_MO, sizes_L)
  # JAX's kernel's dynamic grid mixes int32 and int64.
  with jax.numpy_dtype_promotion("standard"), _sm_count_of_target():
    return transposed_ragged_dot_mgpu.transposed_ragged_dot(
        lhs_MI, d_out_MO, group_sizes=sizes_L, **tiles_for(TRANSPOSED, lhs_MI.shape[1], d_out_MO.shape[1]))


_DUMP_NAME = "mosaic_gpu.dump_basename"


def stable_kernel_hashes():
  """Makes each kernel's `kernel_hash`, and so JAX's persistent-cache key of a program holding it, independent of
  how many Mosaic GPU kernels the process lowered before. From jaxlib 0.11 the lowering stamps every kernel module
  with a dump file name numbered by a process-wide counter (`get_or_set_dump_options`) before hashing its bytes, so
  the planner's step, lowered after other policies, and a rerun's, lowered first, never share a key. Naming the
  module after itself first leaves the counter out; only the names of MOSAIC_GPU_DUMP_* files change. Idempotent;
  nothing to do on a jaxlib without the hook."""
  stamp = getattr(mosaic_dialect, "get_or_set_dump_options", None)
  if stamp is None or getattr(stamp, "stable", False):
    return

  def named_after_itself(module):
    attributes = module.operation.attributes
    if _DUMP_NAME not in attributes:
      name = ir.StringAttr(attributes["sym_name"]).value if "sym_name" in attributes else "mosaic_gpu_module"
      attributes[_DUMP_NAME] = ir.StringAttr.get(name, context=module.context)
    return stamp(module)

  named_after_itself.stable = True
  mosaic_dialect.get_or_set_dump_options = named_after_itself


KERNELS = GroupedKernels(name="mosaic_gpu", forward=forward, lhs_grad=lhs_grad, rhs_grad=rhs_grad,
                         unsupported=unsupported, swiglu=hopper_grouped.gate_up_swiglu,
                         swiglu_unsupported=hopper_grouped.swiglu_unsupported)
