"""A warp-specialized grouped matmul for Hopper (Pallas Mosaic GPU), with an optional SwiGLU epilogue.

No communication. out[m] = lhs[m] @ rhs[l(m)] for rows grouped contiguously by sizes_L (rhs read transposed where
asked). One warpgroup loads through TMA while two compute (each half of the output tile's columns), so the loads of
a tile's next steps run under its matmuls. The (row tile, group) visits are computed before the kernel
(`group_visits`), so a tile costs four scalar loads, not a search over the groups; a tile holding rows of two
groups is visited once per group and stores only its group's rows. Rows past sum(sizes_L) are not written.

With SwiGLU in the epilogue (weights [L, D, 2F] as `gate_up.join` lays them out) a CTA loads a block of gate's
columns and the same block of up's, each warpgroup multiplies half of both, and writes h = silu(gate)·up (and,
where kept, gate|up itself): the [M, 2F] activations need not go to memory and back.

On one H200 at the ring of one's shapes (524288 rows, 128 groups) it ran 623–730 TFLOP/s where JAX's Mosaic
`ragged_dot` ran 411–606; at an EP 8 hop's (32768 rows, 16 groups) 0.85–1.0× of it (benchmarks/results/RUNS.md),
hence `MIN_ROWS`. `interpret=` an `InterpretGPUParams` runs it through Pallas's GPU interpreter (the CPU tests;
rhs read transposed is not interpretable). Shape letters: see relaymoe_jax.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu


@dataclasses.dataclass(frozen=True)
class Tiles:
  """A CTA computes tile_m rows (a power of two: the row stores are a ladder of them) × 2·tile_n columns (tile_n per
  compute warpgroup), tile_k of the contraction per pipeline step, `stages` steps in flight."""

  tile_m: int = 128
  tile_n: int = 128
  tile_k: int = 64
  stages: int = 3


TILES = Tiles()
# Keeping gate|up stores a second output tile, so fewer bytes per pipeline step fit in shared memory.
KEEP_TILES = Tiles(tile_k=32, stages=5)
# The plain kernels run from this many rows: JAX's `ragged_dot` won at 32768 rows (an EP 8 hop), these at 524288.
MIN_ROWS = 131072
SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def takes(m, k, n, dtype, tiles=TILES):
  """Whether the plain kernel should run an [m, k] × [k, n] grouped matmul (either rhs orientation)."""
  return (m >= MIN_ROWS and jnp.dtype(dtype) in SUPPORTED_DTYPES and k % tiles.tile_k == 0
          and n % (2 * tiles.tile_n) == 0)


def forward(lhs_MI, rhs_LIO, sizes_L):
  return grouped_matmul(lhs_MI, rhs_LIO, sizes_L)


def lhs_grad(d_out_MO, rhs_LIO, sizes_L):
  return grouped_matmul(d_out_MO, rhs_LIO, sizes_L, transpose_rhs=True)


def swiglu_unsupported(m, d, u, dtype):
  """None, or why the SwiGLU kernel cannot take x [m, d] against gate/up weights [·, d, u]."""
  if jnp.dtype(dtype) not in SUPPORTED_DTYPES:
    return f"dtype {dtype} (the kernel takes bfloat16 or float16)"
  if d % KEEP_TILES.tile_k or d % TILES.tile_k or u % (2 * TILES.tile_n):
    return f"D={d} or F={u // 2} does not divide into tiles {TILES}"
  return None


def gate_up_swiglu(x_MD, w_gate_up_LDU, sizes_L, keep):
  """(h_MF, gate_up_MU if `keep` else None): x·[gate | up], SwiGLU in the epilogue."""
  if keep:
    return tuple(grouped_matmul(x_MD, w_gate_up_LDU, sizes_L, swiglu=True, keep=True))
  return grouped_matmul(x_MD, w_gate_up_LDU, sizes_L, swiglu=True), None


def group_visits(sizes_L, rows, tile_m):
  """Per visit: the row tile, its group, and that group's rows [lo, hi) in it (lo = hi for unused visits), as
  int32 [V] arrays, V = every tile once plus one per group boundary inside a tile."""
  groups = sizes_L.shape[0]
  ends_L = jnp.cumsum(sizes_L.astype(jnp.int32))
  starts_L = ends_L - sizes_L
  first_L, last_L = starts_L // tile_m, (ends_L - 1) // tile_m
  count_L = jnp.where(sizes_L > 0, last_L - first_L + 1, 0)
  visit_ends_L = jnp.cumsum(count_L)
  v_V = jnp.arange(pl.cdiv(rows, tile_m) + groups - 1, dtype=jnp.int32)
  group_V = jnp.minimum(jnp.searchsorted(visit_ends_L, v_V, side="right"), groups - 1).astype(jnp.int32)
  used_V = v_V < visit_ends_L[-1]
  tile_V = first_L[group_V] + v_V - (visit_ends_L - count_L)[group_V]
  lo_V = jnp.maximum(starts_L[group_V], tile_V * tile_m)
  hi_V = jnp.minimum(ends_L[group_V], (tile_V + 1) * tile_m)
  return tuple(jnp.where(used_V, a, 0) for a in (tile_V, group_V, lo_V, hi_V))


def _store_rows(out_smem, out_gmem, first_row, lo, count, col, tile_m):
  """TMA-stores rows [lo, lo + count) of the tile starting at `first_row` (count ≤ tile_m, known only at run time)
  as a ladder of power-of-two row blocks, each a static TMA shape."""
  start = lo - first_row
  size = tile_m
  while size >= 1:
    @pl.when(count & size != 0)
    def _():
      plgpu.copy_smem_to_gmem(out_smem.at[pl.ds(start, size)],
                              out_gmem.at[pl.ds(first_row + start, size), pl.ds(col, out_smem.shape[1])])

    start = start + (count & size)
    size //= 2


def _silu_times(gate, up):
  return gate / (1.0 + jnp.exp(-gate)) * up


def grouped_matmul(lhs_MK, rhs_LKN, sizes_L, *, tiles=None, transpose_rhs=False, swiglu=False, keep=False,
                   num_sms=None, interpret=False):
  """lhs [M, K] × rhs [L, K, N] ([L, N, K] with `transpose_rhs`) → [M, N] in lhs's dtype, float32 accumulation.
  With `swiglu` (rhs [L, K, U], U = 2F in `gate_up`'s layout) → h [M, F], and with `keep` also the [M, U] product
  itself: (h, gate_up). `tiles`: default TILES, or KEEP_TILES where a second output tile must fit."""
  tiles = tiles or (KEEP_TILES if keep else TILES)
  m, k = lhs_MK.shape
  n = rhs_LKN.shape[1] if transpose_rhs else rhs_LKN.shape[2]
  tile_m, tile_n, tile_k = tiles.tile_m, tiles.tile_n, tiles.tile_k
  if swiglu:  # a CTA's gate block and the same block of up: each warpgroup takes half of both
    f = n // 2
    n_iters, block_n, wg_n = f // tile_n, tile_n, tile_n // 2
    block_cols = lambda ni: (ni * tile_n, f + ni * tile_n)
    out_types = [(m, f)] + [(m, n)] * keep
  else:
    n_iters, block_n, wg_n = n // (2 * tile_n), 2 * tile_n, tile_n
    block_cols = lambda ni: (ni * 2 * tile_n,)
    out_types = [(m, n)]
  if k % tile_k or n % (2 * tile_n):
    raise ValueError(f"K={k} must divide by tile_k={tile_k} and N={n} by 2·tile_n={2 * tile_n}")
  k_iters, blocks = k // tile_k, 2 if swiglu else 1
  visits = group_visits(sizes_L, m, tile_m)
  num_visits = visits[0].shape[0]
  dtype = lhs_MK.dtype
  # Per warpgroup, what its tile stores: (which output, at which column of this tile's block).
  stores = [(0, 0)] + ([(1, 0), (1, f)] if swiglu and keep else [])

  def body(tile_gmem, group_gmem, lo_gmem, hi_gmem, lhs_gmem, rhs_gmem, *out_gmem):
    rhs_spec = (plgpu.BlockSpec((block_n, tile_k), lambda kk: (0, kk)) if transpose_rhs
                else plgpu.BlockSpec((tile_k, block_n), lambda kk: (kk, 0)))

    def pipeline(mma, context):
      return plgpu.emit_pipeline_warp_specialized(
          mma, grid=(k_iters,), memory_registers=40, wg_axis="wg", num_compute_wgs=2,
          max_concurrent_steps=tiles.stages, compute_context=context,
          in_specs=[plgpu.BlockSpec((tile_m, tile_k), lambda kk: (0, kk))] + [rhs_spec] * blocks)

    ignore = lambda *_, **__: None

    @functools.partial(pl.run_scoped,
                       allocations=pipeline(ignore, ignore).get_allocations(lhs_gmem, *[rhs_gmem] * blocks),
                       out_smem=[plgpu.SMEM((2, tile_m, wg_n), dtype) for _ in stores], collective_axes="wg")
    def scope(allocations, out_smem):
      wg = lax.axis_index("wg")

      @plgpu.nd_loop((num_visits * n_iters,), collective_axes="sm")
      def visit_loop(info):
        (idx,) = info.index
        v, ni = idx // n_iters, idx % n_iters
        tile, group, lo, hi = tile_gmem[v], group_gmem[v], lo_gmem[v], hi_gmem[v]
        col = (ni * 2 + wg) * wg_n  # this warpgroup's first output column

        def context(eval_pipeline):
          def acc_scope(*acc_refs):
            eval_pipeline(acc_refs)
            accs = [a[...] for a in acc_refs]
            outs = [_silu_times(*accs) if swiglu else accs[0]] + (accs if swiglu and keep else [])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's stores have read out_smem
            for out, smem in zip(outs, out_smem):
              smem[wg] = out.astype(dtype)
            plgpu.commit_smem()
            for smem, (out, offset) in zip(out_smem, stores):
              _store_rows(smem.at[wg], out_gmem[out], tile * tile_m, lo, hi - lo, offset + col, tile_m)

          pl.run_scoped(acc_scope, *[plgpu.ACC((tile_m, wg_n), jnp.float32)] * blocks)

        def mma(_, lhs_smem, *rest):
          *rhs_smem, acc_refs = rest
          for rhs, acc_ref in zip(rhs_smem, acc_refs):
            if transpose_rhs:
              rhs = rhs.at[pl.ds(wg * wg_n, wg_n)].transpose((1, 0))
            else:
              rhs = rhs.at[:, pl.ds(wg * wg_n, wg_n)]
            plgpu.wgmma(acc_ref, lhs_smem, rhs)
          plgpu.wgmma_wait(0)
          return acc_refs

        @pl.when(hi > lo)
        def _():
          cols = [pl.ds(c, block_n) for c in block_cols(ni)]
          rhs = [rhs_gmem.at[group, c, :] if transpose_rhs else rhs_gmem.at[group, :, c] for c in cols]
          pipeline(mma, context)(lhs_gmem.at[pl.ds(tile * tile_m, tile_m), :], *rhs, allocations=allocations)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  kernel = plgpu.kernel(
      body, out_type=tuple(jax.ShapeDtypeStruct(shape, dtype) for shape in out_types),
      grid=(num_sms or num_sms_of_target(),), grid_names=("sm",), num_threads=3, thread_name="wg", interpret=interpret,
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
  outs = kernel(*visits, lhs_MK, rhs_LKN)
  return outs if keep else outs[0]


def num_sms_of_target():
  """The SMs of the GPUs being compiled for: the mesh's (a compile-only topology), else this process's."""
  target = jax.sharding.get_abstract_mesh().abstract_device
  return target.num_cores if target is not None else jax.devices()[0].core_count
