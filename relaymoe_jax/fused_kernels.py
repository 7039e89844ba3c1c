"""The SwiGLU expert's grouped matmuls fused with what surrounds them (Pallas Triton): rows read by token index
inside the kernel (no gathered [M, D] copy of x or dy), SwiGLU in the gate/up epilogue, and SwiGLU's derivative in
the epilogue of the down projection's input gradient.

No communication. Rows are grouped contiguously by expert (`sizes_L`); row m reads token tok_M[m]. Like the other
kernels, these may leave anything in rows past sum(sizes_L). Three kernels:
  gate_up_swiglu   x[tok]·[gate | up] → h = silu(gate)·up, and gate|up where a backward keeps them;
  down_grad        dh = dy[tok]·W_downᵀ → d(gate|up) by SwiGLU's derivative, w·h (the down weight's gradient
                   reads it) and Σ_F dh·h per column block (the router weight's gradient);
  weight_grad      per group, a[rows]ᵀ·b[rows], either side read by token index.
A row tile may hold rows of several groups: a grid step is one visit (tile, group) (`group_visits`), masked to
the rows of its group, so a tile is visited once per group it holds and no step writes another's rows. The output
column block is the grid's fastest axis (Triton launches program_id(0) fastest): the steps running together read
the same rows (once from HBM, then from L2) and one group's weights, which L2 holds across its visits.

`interpret=True` runs them through Pallas's interpreter (any backend: the CPU tests); otherwise they lower to
Triton for NVIDIA GPUs. Shape letters: see relaymoe_jax.
"""

import dataclasses
import functools
import json
import pathlib
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from relaymoe_jax.grouped_kernels import fill_past_groups
from relaymoe_jax.layout import vary_like, varying_axes


@dataclasses.dataclass(frozen=True)
class Tiles:
  """block_m rows × block_n output columns per grid step, block_k of the contraction per loop step."""

  block_m: int = 128
  block_n: int = 64
  block_k: int = 64
  num_warps: int = 8
  num_stages: int = 3


DEFAULT_TILES = Tiles()
TILES_FILE = pathlib.Path(__file__).with_name("fused_tiles.json")


class Visits(NamedTuple):
  """Per grid step along rows: the row tile, its group, and the rows [lo, hi) of that group in the tile (lo = hi:
  nothing, for the steps past the last visit)."""

  tile_V: jax.Array
  group_V: jax.Array
  lo_V: jax.Array
  hi_V: jax.Array


def max_visits(rows, groups, block_m):
  """Visits enough for any sizes: every tile once, plus one more per group boundary inside a tile."""
  return rows // block_m + groups - 1


def group_visits(sizes_L, rows, block_m):
  """The (tile, group) visits of rows grouped by `sizes_L` in tiles of `block_m`, in row order."""
  groups = sizes_L.shape[0]
  ends_L = jnp.cumsum(sizes_L.astype(jnp.int32))
  starts_L = ends_L - sizes_L
  first_L, last_L = starts_L // block_m, (ends_L - 1) // block_m
  count_L = jnp.where(sizes_L > 0, last_L - first_L + 1, 0)
  visit_ends_L = jnp.cumsum(count_L)
  v_V = jnp.arange(max_visits(rows, groups, block_m), dtype=jnp.int32)
  group_V = jnp.minimum(jnp.searchsorted(visit_ends_L, v_V, side="right"), groups - 1).astype(jnp.int32)
  used_V = v_V < visit_ends_L[-1]
  tile_V = first_L[group_V] + v_V - (visit_ends_L - count_L)[group_V]
  lo_V = jnp.maximum(starts_L[group_V], tile_V * block_m)
  hi_V = jnp.minimum(ends_L[group_V], (tile_V + 1) * block_m)
  return Visits(tile_V=jnp.where(used_V, tile_V, 0), group_V=jnp.where(used_V, group_V, 0),
                lo_V=jnp.where(used_V, lo_V, 0), hi_V=jnp.where(used_V, hi_V, 0))


def _for_visit(visits, block_m, body):
  """body(first row of this step's tile, its group, mask of the tile's rows that are that group's, column block),
  where the step visits any rows."""
  n, v = pl.program_id(0), pl.program_id(1)  # read here: the interpreter substitutes them only outside `when`
  tile, group, lo, hi = (ref[v] for ref in visits)
  rows = tile * block_m + jnp.arange(block_m, dtype=jnp.int32)
  pl.when(lo < hi)(lambda: body(first=tile * block_m, group=group, valid=(rows >= lo) & (rows < hi), n=n))


def _gathered_matmul(src_ref, tok, w_ref, group, cols, block_k, width, transpose_w=False):
  """For each column block in `cols`, Σ over the contraction of src[tok]·w[group][:, col] (or ·w[group][col, :]ᵀ),
  float32; each block of src rows is read once for all of them."""

  def step(k, accs):
    ks = pl.ds(k * block_k, block_k)
    a = src_ref[tok, ks]
    if transpose_w:
      ws = [plt.load(w_ref.at[group, col, ks]) for col in cols]
      return tuple(acc + plt.dot(a.astype(w.dtype), w, trans_b=True) for acc, w in zip(accs, ws))
    ws = [plt.load(w_ref.at[group, ks, col]) for col in cols]
    return tuple(acc + plt.dot(a.astype(w.dtype), w) for acc, w in zip(accs, ws))

  zeros = tuple(jnp.zeros((tok.shape[0], col.size), jnp.float32) for col in cols)
  return jax.lax.fori_loop(0, width // block_k, step, zeros)


def _silu(g):
  return g * jax.nn.sigmoid(g)


def _gate_up_kernel(*refs, tiles, width, ffn, outputs):
  _for_visit(refs[:4], tiles.block_m, functools.partial(_gate_up_visit, *refs[4:], tiles=tiles, width=width,
                                                        ffn=ffn, outputs=outputs))


def _gate_up_visit(tok_ref, x_ref, w_ref, *out_refs, first, group, valid, n, tiles, width, ffn, outputs):
  out = dict(zip(outputs, out_refs))
  rows = pl.ds(first, tiles.block_m)
  tok = plt.load(tok_ref.at[rows], mask=valid, other=0)
  gate_cols, up_cols = pl.ds(n * tiles.block_n, tiles.block_n), pl.ds(ffn + n * tiles.block_n, tiles.block_n)
  gate, up = _gathered_matmul(x_ref, tok, w_ref, group, (gate_cols, up_cols), tiles.block_k, width)
  mask = jnp.broadcast_to(valid[:, None], (tiles.block_m, tiles.block_n))  # Triton masks match their values
  if "h" in out:
    plt.store(out["h"].at[rows, gate_cols], (_silu(gate) * up).astype(out["h"].dtype), mask=mask)
  if "gate_up" in out:
    gate_up_ref = out["gate_up"]
    plt.store(gate_up_ref.at[rows, gate_cols], gate.astype(gate_up_ref.dtype), mask=mask)
    plt.store(gate_up_ref.at[rows, up_cols], up.astype(gate_up_ref.dtype), mask=mask)


def _call(kernel, out_shape, grid, tiles, interpret, *args):
  """The kernel over `grid`. Inside shard_map the inputs and outputs all vary over every mesh axis any input
  varies over (pallas_call needs the outputs' and cannot infer them)."""
  axes = tuple(sorted(set().union(*(varying_axes(a) for a in args))))
  args = [vary_like(a, axes) for a in args]
  manual = getattr(jax.typeof(args[0]), "manual_axis_type", None)
  if manual is not None:
    out_shape = [jax.ShapeDtypeStruct(s.shape, s.dtype, manual_axis_type=manual) for s in out_shape]
  params = {} if interpret else dict(compiler_params=plt.CompilerParams(num_warps=tiles.num_warps,
                                                                         num_stages=tiles.num_stages))
  return pl.pallas_call(kernel, out_shape=out_shape, grid=grid, interpret=interpret, **params)(*args)


@functools.partial(jax.jit, static_argnames=("tiles", "outputs", "interpret"))
def gate_up_swiglu(x_TD, tok_M, w_gate_up_LDU, sizes_L, *, tiles=DEFAULT_TILES, outputs=("h",), interpret=False):
  """The `outputs` asked for, in that order, of the rows of group l, in x's dtype from float32 products:
  "h": h_MF = silu(x[tok]·gate[l]) · (x[tok]·up[l]); "gate_up": gate_up_MU = x[tok]·[gate | up]."""
  rows, (_, width, fused) = tok_M.shape[0], w_gate_up_LDU.shape
  ffn = fused // 2
  visits = group_visits(sizes_L, rows, tiles.block_m)
  widths = {"h": ffn, "gate_up": fused}
  out = [jax.ShapeDtypeStruct((rows, widths[name]), x_TD.dtype) for name in outputs]
  kernel = functools.partial(_gate_up_kernel, tiles=tiles, width=width, ffn=ffn, outputs=outputs)
  return tuple(_call(kernel, out, (ffn // tiles.block_n, visits.tile_V.shape[0]), tiles, interpret, *visits,
                     tok_M, x_TD, w_gate_up_LDU))


def _down_grad_kernel(*refs, tiles, width, ffn):
  _for_visit(refs[:4], tiles.block_m, functools.partial(_down_grad_visit, *refs[4:], tiles=tiles, width=width,
                                                        ffn=ffn))


def _down_grad_visit(tok_ref, dy_ref, w_ref, gate_up_ref, weight_ref, d_gate_up_ref, hw_ref, dw_ref, *, first,
                     group, valid, n, tiles, width, ffn):
  rows = pl.ds(first, tiles.block_m)
  tok = plt.load(tok_ref.at[rows], mask=valid, other=0)
  gate_cols, up_cols = pl.ds(n * tiles.block_n, tiles.block_n), pl.ds(ffn + n * tiles.block_n, tiles.block_n)
  (dh,) = _gathered_matmul(dy_ref, tok, w_ref, group, (gate_cols,), tiles.block_k, width, transpose_w=True)
  mask = jnp.broadcast_to(valid[:, None], (tiles.block_m, tiles.block_n))  # Triton masks match their values
  gate = plt.load(gate_up_ref.at[rows, gate_cols], mask=mask, other=0).astype(jnp.float32)
  up = plt.load(gate_up_ref.at[rows, up_cols], mask=mask, other=0).astype(jnp.float32)
  weight = plt.load(weight_ref.at[rows], mask=valid, other=0).astype(jnp.float32)[:, None]
  d_gate, d_up, hw, dw = swiglu_grads(dh, gate, up, weight, hw_ref.dtype)
  plt.store(d_gate_up_ref.at[rows, gate_cols], d_gate.astype(d_gate_up_ref.dtype), mask=mask)
  plt.store(d_gate_up_ref.at[rows, up_cols], d_up.astype(d_gate_up_ref.dtype), mask=mask)
  plt.store(hw_ref.at[rows, gate_cols], hw.astype(hw_ref.dtype), mask=mask)
  plt.store(dw_ref.at[rows, n], dw, mask=valid)


def swiglu_grads(dh, gate, up, weight, dtype):
  """From dh = dy·W_downᵀ and the rows' gate, up and router weight (float32): (d_gate, d_up, weight·h, Σ dh·h),
  with h = silu(gate)·up rounded to `dtype` as the forward wrote it."""
  sigmoid = jax.nn.sigmoid(gate)
  silu = gate * sigmoid
  h = (silu * up).astype(dtype).astype(jnp.float32)
  d_h = dh * weight
  return d_h * up * sigmoid * (1 + gate * (1 - sigmoid)), d_h * silu, h * weight, jnp.sum(dh * h, axis=1)


@functools.partial(jax.jit, static_argnames=("tiles", "interpret"))
def down_grad(dy_TD, tok_M, w_down_LFD, gate_up_MU, weight_M, sizes_L, *, tiles=DEFAULT_TILES, interpret=False):
  """The down projection's input gradient through SwiGLU, for rows weighted by their router weight: with
  dh = dy[tok]·W_down[l]ᵀ and h = silu(gate)·up (rounded to the weights' dtype, as the forward wrote it),
  (d_gate_up_MU = weight·dh through SwiGLU's derivative, hw_MF = weight·h, dw_M = Σ_F dh·h); the first two in the
  weights' dtype (the compute dtype, whatever dy's), dw_M float32."""
  rows, (_, ffn, width) = tok_M.shape[0], w_down_LFD.shape
  visits = group_visits(sizes_L, rows, tiles.block_m)
  blocks = ffn // tiles.block_n
  dtype = w_down_LFD.dtype
  out = [jax.ShapeDtypeStruct((rows, 2 * ffn), dtype), jax.ShapeDtypeStruct((rows, ffn), dtype),
         jax.ShapeDtypeStruct((rows, blocks), jnp.float32)]
  kernel = functools.partial(_down_grad_kernel, tiles=tiles, width=width, ffn=ffn)
  d_gate_up, hw, dw_MN = _call(kernel, out, (blocks, visits.tile_V.shape[0]), tiles, interpret, *visits, tok_M,
                               dy_TD, w_down_LFD, gate_up_MU, weight_M)
  return d_gate_up, hw, jnp.sum(dw_MN, axis=1)


def _weight_grad_kernel(starts_ref, ends_ref, a_ref, b_ref, *refs, tiles, a_tok, b_tok):
  refs = list(refs)
  a_tok_ref = refs.pop(0) if a_tok else None
  b_tok_ref = refs.pop(0) if b_tok else None
  (out_ref,) = refs
  o, i, group = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  start, end = starts_ref[group], ends_ref[group]
  in_cols, out_cols = pl.ds(i * tiles.block_m, tiles.block_m), pl.ds(o * tiles.block_n, tiles.block_n)

  def read(ref, tok_ref, rows, valid, cols):
    """Rows past the group read row 0 (it stays cached) and count as zeros."""
    if tok_ref is not None:
      rows = jnp.where(valid, tok_ref[rows], 0)
    return jnp.where(valid[:, None], ref[rows, cols], 0)

  def step(k, acc):
    first = start + k * tiles.block_k
    rows = first + jnp.arange(tiles.block_k, dtype=jnp.int32)
    valid = rows < end
    rows = jnp.where(valid, rows, 0)
    a = read(a_ref, a_tok_ref, rows, valid, in_cols)
    b = read(b_ref, b_tok_ref, rows, valid, out_cols).astype(a.dtype)
    return acc + plt.dot(a, b, trans_a=True)

  steps = (end - start + tiles.block_k - 1) // tiles.block_k
  acc = jax.lax.fori_loop(0, steps, step, jnp.zeros((tiles.block_m, tiles.block_n), jnp.float32))
  out_ref[group, in_cols, out_cols] = acc.astype(out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("tiles", "interpret"))
def weight_grad(a_NI, b_NO, sizes_L, a_tok_M=None, b_tok_M=None, *, tiles=DEFAULT_TILES, interpret=False):
  """out_LIO[l] = Σ over group l's rows m of a[m]ᵀ·b[m], row m of a side read at its token index where that side's
  tok_M is given (a, b: [tokens or rows, width]), in a's dtype from float32 sums; zero for an empty group."""
  (_, width_in), (_, width_out), groups = a_NI.shape, b_NO.shape, sizes_L.shape[0]
  ends_L = jnp.cumsum(sizes_L.astype(jnp.int32))
  toks = [t for t in (a_tok_M, b_tok_M) if t is not None]
  kernel = functools.partial(_weight_grad_kernel, tiles=tiles, a_tok=a_tok_M is not None,
                             b_tok=b_tok_M is not None)
  out = [jax.ShapeDtypeStruct((groups, width_in, width_out), a_NI.dtype)]
  grid = (width_out // tiles.block_n, width_in // tiles.block_m, groups)
  return _call(kernel, out, grid, tiles, interpret, ends_L - sizes_L, ends_L, a_NI, b_NO, *toks)[0]


def _past_rows(x_M, sizes_L):
  """NaN in rows past sum(sizes): the references leave garbage there, as the kernels may."""
  return fill_past_groups(x_M, sizes_L, jnp.nan)


def _ragged(lhs_MI, rhs_LIO, sizes_L):
  return jax.lax.ragged_dot(lhs_MI, rhs_LIO, sizes_L, precision=jax.lax.Precision.HIGHEST,
                            preferred_element_type=jnp.float32)


def reference_gate_up_swiglu(x_TD, tok_M, w_gate_up_LDU, sizes_L, *, outputs=("h",), **_):
  """`gate_up_swiglu` in lax on gathered rows: the contract the kernels meet, for tests and any backend."""
  gate_up = _ragged(x_TD[tok_M], w_gate_up_LDU, sizes_L)
  gate, up = jnp.split(gate_up, 2, axis=1)
  values = {"h": _silu(gate) * up, "gate_up": gate_up}
  return tuple(_past_rows(values[name].astype(x_TD.dtype), sizes_L) for name in outputs)


def reference_down_grad(dy_TD, tok_M, w_down_LFD, gate_up_MU, weight_M, sizes_L, **_):
  """`down_grad` in lax on gathered rows."""
  dh = _ragged(dy_TD[tok_M].astype(w_down_LFD.dtype), jnp.swapaxes(w_down_LFD, 1, 2), sizes_L)
  gate, up = jnp.split(gate_up_MU.astype(jnp.float32), 2, axis=1)
  dtype = w_down_LFD.dtype
  d_gate, d_up, hw, dw = swiglu_grads(dh, gate, up, weight_M.astype(jnp.float32)[:, None], dtype)
  return (_past_rows(jnp.concatenate([d_gate, d_up], axis=1).astype(dtype), sizes_L),
          _past_rows(hw.astype(dtype), sizes_L), _past_rows(dw, sizes_L))


def reference_weight_grad(a_NI, b_NO, sizes_L, a_tok_M=None, b_tok_M=None, **_):
  """`weight_grad` in lax on gathered rows (rows past sum(sizes) count as zeros)."""
  a = a_NI if a_tok_M is None else a_NI[a_tok_M]
  b = (b_NO if b_tok_M is None else b_NO[b_tok_M]).astype(a.dtype)
  valid = (jnp.arange(a.shape[0]) < jnp.sum(sizes_L))[:, None]
  dims = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((0,), (0,)), ((), ())),
                                           lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
  return jax.lax.ragged_dot_general(jnp.where(valid, a, 0), jnp.where(valid, b, 0), sizes_L, dims,
                                    precision=jax.lax.Precision.HIGHEST,
                                    preferred_element_type=jnp.float32).astype(a_NI.dtype)


@functools.lru_cache(maxsize=1)
def tuned_tiles():
  return json.loads(TILES_FILE.read_text()) if TILES_FILE.exists() else {}


KERNELS = ("gate_up_swiglu", "down_grad", "weight_grad")


def tiles_for(width, ffn, kernel):
  """The tiles of `kernel` (one of KERNELS) for experts of width D and FFN width F: `fused_tiles.json`'s (written
  by `python -m benchmarks.fused_expert --tune`), else DEFAULT_TILES."""
  tuned = tuned_tiles().get(f"{width}x{ffn}", {}).get(kernel)
  return Tiles(**tuned) if tuned else DEFAULT_TILES


class KernelSet(NamedTuple):
  """The three kernels of one implementation, for inputs of `dtypes` (None: any), each called with
  tiles=tiles_for(D, F, its name); `backward`: whether the hop's backward runs them (else only the forward's
  gate/up does, and the backward runs the plain grouped matmuls on gathered rows)."""

  gate_up_swiglu: Callable
  down_grad: Callable
  weight_grad: Callable
  tiles_for: Callable
  dtypes: tuple | None
  backward: bool

  def unsupported(self, rows, width, ffn, dtype):
    """None, or why these kernels cannot take `rows` of width D (`width`) for experts of FFN width `ffn`."""
    if self.dtypes is not None and jnp.dtype(dtype) not in self.dtypes:
      return f"dtype {jnp.dtype(dtype)} (these kernels take {' or '.join(map(str, self.dtypes))})"
    up, down, weight = (self.tiles_for(width, ffn, k) for k in KERNELS)
    # Rows and widths against each kernel's tiles: the weight gradients' outputs are D × 2F and F × D.
    checks = [("rows", rows, up.block_m), ("D", width, up.block_k), ("F", ffn, up.block_n)]
    if self.backward:
      checks += [("rows", rows, down.block_m), ("D", width, down.block_k), ("F", ffn, down.block_n),
                 ("D", width, weight.block_m), ("D", width, weight.block_n), ("F", ffn, weight.block_m)]
    for what, n, block in checks:
      if n % block:
        return f"{what}={n} is not a multiple of {block}"
    return None


# float32 would run as TF32 in Triton's dot: such steps keep the plain path, as the Mosaic kernels do. On one H200
# only gate_up_swiglu beat the plain steps it replaces (benchmarks/results/fused_expert.txt): the backward keeps
# the Mosaic kernels on gathered rows.
TRITON = KernelSet(gate_up_swiglu, down_grad, weight_grad, tiles_for, (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)),
                   backward=False)
# The references take any tiles; these small ones make the hop tests' chunks take the fused path as the kernels would.
REFERENCE = KernelSet(reference_gate_up_swiglu, reference_down_grad, reference_weight_grad,
                      lambda width, ffn, kernel: Tiles(block_m=8, block_n=8, block_k=8), None, backward=True)
