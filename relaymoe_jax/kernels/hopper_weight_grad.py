"""A warp-specialized grouped weight gradient for Hopper (Pallas Mosaic GPU): the grouped matmul's third kernel.

No communication. out[l] = lhs[rows of l]ᵀ @ d_out[rows of l] for rows grouped contiguously by sizes_L: [L, I, O],
zeros for an empty group. One warpgroup loads through TMA while two compute; a CTA's output tile is tile_m rows of
I (half per compute warpgroup) × tile_n columns of O, and its contraction runs over the group's rows in steps of
tile_k, as many as the group spans (a dynamic pipeline length). The first and last steps straddle other groups'
rows (or rows past sum(sizes_L)): each compute warpgroup zeroes those rows of its half of the lhs block in shared
memory by selection, so NaN or Inf there never reaches the product, before it multiplies. Pallas's GPU
interpreter cannot run it (a transposed shared-memory operand hangs it): its tests run on a Hopper GPU. Shape
letters: see relaymoe_jax.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from relaymoe_jax.kernels.hopper_grouped import SUPPORTED_DTYPES, num_sms_of_target


@dataclasses.dataclass(frozen=True)
class Tiles:
  """A CTA computes tile_m rows of I (tile_m / 2 per compute warpgroup) × tile_n columns of O, contracting tile_k
  rows per pipeline step with `stages` steps in flight."""

  tile_m: int = 128
  tile_n: int = 256
  tile_k: int = 64
  stages: int = 3


TILES = Tiles()
# On one H200 it ran 1.07–1.16× JAX's `transposed_ragged_dot` at the ring of one's shapes (262144 rows, 128
# groups), an EP 2 hop's and an EP 8 hop's (32768 rows, 16 groups): grouped_gemm runs 5 and 6 in
# benchmarks/results/RUNS.md. Fewer rows were not measured, so JAX's kernel keeps them.
MIN_ROWS = 32768


def takes(m, i, o, dtype, tiles=TILES):
  """Whether this kernel should compute the [L, i, o] weight gradient of an m-row grouped matmul."""
  return (m >= MIN_ROWS and jnp.dtype(dtype) in SUPPORTED_DTYPES and m % tiles.tile_k == 0
          and i % tiles.tile_m == 0 and o % tiles.tile_n == 0)


def group_blocks(sizes_L, tile_k):
  """Per group: its rows [start, end), the first tile_k-aligned row block holding them, and how many blocks they
  span (an empty group: block 0, one block, every row masked), as int32 [L] arrays."""
  sizes_L = sizes_L.astype(jnp.int32)
  end_L = jnp.cumsum(sizes_L)
  start_L = end_L - sizes_L
  first_L = jnp.where(sizes_L > 0, start_L // tile_k * tile_k, 0)
  count_L = jnp.where(sizes_L > 0, pl.cdiv(end_L - first_L, tile_k), 1)
  return start_L, end_L, first_L, count_L


def weight_grad(lhs_MI, d_out_MO, sizes_L, *, tiles=TILES, num_sms=None):
  """[L, I, O] in lhs's dtype, float32 accumulation: per group, lhs[rows of l]ᵀ @ d_out[rows of l]."""
  (m, i), o, groups = lhs_MI.shape, d_out_MO.shape[1], sizes_L.shape[0]
  tile_m, tile_n, tile_k = tiles.tile_m, tiles.tile_n, tiles.tile_k
  if m % tile_k or i % tile_m or o % tile_n:
    raise ValueError(f"M={m} must divide by tile_k={tile_k}, I={i} by tile_m={tile_m} and O={o} by "
                     f"tile_n={tile_n}")
  wg_m, grid_m, grid_n = tile_m // 2, i // tile_m, o // tile_n
  dtype = lhs_MI.dtype

  def body(start_gmem, end_gmem, first_gmem, count_gmem, lhs_gmem, d_out_gmem, out_gmem):
    def pipeline(mma, context, steps, mi=0, ni=0):
      return plgpu.emit_pipeline_warp_specialized(
          mma, grid=(steps,), memory_registers=40, wg_axis="wg", num_compute_wgs=2,
          max_concurrent_steps=tiles.stages, compute_context=context,
          in_specs=[plgpu.BlockSpec((tile_k, tile_m), lambda kk: (kk, mi)),
                    plgpu.BlockSpec((tile_k, tile_n), lambda kk: (kk, ni))])

    ignore = lambda *_, **__: None
    # Allocations depend on the blocks and stages alone: any static length stands in for the groups' own.
    allocations = pipeline(ignore, ignore, m // tile_k).get_allocations(lhs_gmem, d_out_gmem)

    @functools.partial(pl.run_scoped, allocations=allocations,
                       out_smem=plgpu.SMEM((2, wg_m, tile_n), dtype), collective_axes="wg")
    def scope(allocations, out_smem):
      wg = lax.axis_index("wg")

      @plgpu.nd_loop((groups * grid_m * grid_n,), collective_axes="sm")
      def visit_loop(info):
        (idx,) = info.index
        group, mi, ni = idx // (grid_m * grid_n), idx // grid_n % grid_m, idx % grid_n
        start, end, first, count = start_gmem[group], end_gmem[group], first_gmem[group], count_gmem[group]

        def context(eval_pipeline):
          def acc_scope(acc_ref):
            eval_pipeline(acc_ref)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's store has read out_smem
            out_smem[wg] = acc_ref[...].astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(
                out_smem.at[wg], out_gmem.at[group, pl.ds(mi * tile_m + wg * wg_m, wg_m), pl.ds(ni * tile_n, tile_n)])

          pl.run_scoped(acc_scope, plgpu.ACC((wg_m, tile_n), jnp.float32))

        def mma(index, lhs_smem, d_out_smem, acc_ref):
          (kk,) = index
          lhs_half = lhs_smem.at[:, pl.ds(wg * wg_m, wg_m)]

          @pl.when((kk == 0) | (kk == count - 1))
          def _():
            rows = first + kk * tile_k + plgpu.layout_cast(
                lax.broadcasted_iota(jnp.int32, (tile_k, wg_m), 0), plgpu.Layout.WGMMA)
            lhs_half[...] = jnp.where((rows >= start) & (rows < end), lhs_half[...], jnp.zeros((), dtype))
            plgpu.commit_smem()

          plgpu.wgmma(acc_ref, lhs_half.transpose((1, 0)), d_out_smem)
          plgpu.wgmma_wait(0)
          return acc_ref

        # The slices run past M from a group's first block on; the pipeline reads only its `count` blocks.
        rows = pl.ds(pl.multiple_of(first, tile_k), m)
        pipeline(mma, context, count, mi, ni)(lhs_gmem.at[rows], d_out_gmem.at[rows], allocations=allocations)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  kernel = plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((groups, i, o), dtype),
      grid=(num_sms or num_sms_of_target(),), grid_names=("sm",), num_threads=3, thread_name="wg",
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
  return kernel(*group_blocks(sizes_L, tile_k), lhs_MI, d_out_MO)
