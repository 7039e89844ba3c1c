"""The gated delta rule's forward in three Pallas (Triton) kernels, on the chunked form (`gated_delta`'s docstring) in
head-major layout ([B, H, N, C, ·]: no operand needs moving) but v, read where it lies ([B, N, C, H, V]), q and k at
their key heads, and the helpers the backward's kernels (`gated_delta_backward_kernels`) share;
`gated_delta_kernel_path` runs the rule on them:

- `chunk_wy`: each chunk's T = (I + A)⁻¹, U = T βV and W = T (K ⊙ β m exp(Γ)), A = strictly lower
  (diag(β) K Kᵀ) ⊙ D, all formed in the kernel from the keys, values, β, Γ and the documents, one program per
  (row, value head, run of chunks: `over_chunks` loops a one-chunk kernel over its program's run). T's diagonal
  blocks of 16 by forward substitution, the blocks below them by block inversion. The backward takes T and W
  as the forward made them (or, for rows in spans, runs this kernel again).
- `state_forward`: the loop over chunks carrying the state S [K, V], one program per (row, value head, block of V)
  keeping its slice of S on chip, the decayed keys Kd = K ⊙ e exp(Γ_C − Γ) formed from K and Γ as it goes:

    forward, chunk n:  S_n = S (stored),  V_new = U − W S,  S ← d S + Kdᵀ V_new
    backward, n from the last chunk down, carrying dS' (the gradient of the state leaving chunk n):
      dS'_n = dS' (stored),  dV_new = ∂V_new + Kd dS',  dS' ← d dS' + ∂S_n − Wᵀ dV_new

  with ∂ the cotangents that reach S_n and V_new from the output (the backward: `state_backward`).
- `chunk_output`: O = (Q ⊙ m exp(Γ)) S_n + ((Q Kᵀ) ⊙ D) V_new, one program per (row, value head, chunk, 128 columns
  of V), written straight into [B, S, H, V]; P and the decays never leave the kernel.

Operands are bfloat16 unless the inputs are float32 (then float32 at HIGHEST precision); the state, its gradient
and the decays are float32 inside. Each takes `interpret`: the kernel path runs them in Pallas' interpreter wherever
the program is lowered for anything but CUDA (the tests' path).

Shape letters: see relaymoe_jax (the gated delta rule's own).
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

BLOCK = 16  # the inverse's diagonal blocks: the smallest a tensor-core dot takes
BLOCK_V = 64  # V columns per state-pass program (S's slice [K, 64] in float32 stays in registers) and the backward's
# column blocks: fla's choice too
MIN_PROGRAMS = 256  # about two per SM of an H200 (132): a long row with few heads splits V finer to fill them
# Triton's software pipelining of the loop over chunks: the next chunk's loads overlap this chunk's matmuls (an H200,
# 16 x 4096, Qwen3.5's heads: 1.46 / 2.82 ms forward / backward against 1.88 / 3.27 with one stage).
STATE_STAGES = 2
# The most chunks `chunk_wy`'s program takes in turn (a run: `run_length`), its loop over them pipelined as the state
# pass's is: each program waited on its loads (one H100, 16 x 4096: 3.19 -> 2.07 ms against one chunk a program).
WY_CHUNKS = 4
RUN_STAGES = 2


def _precision(dtype):
  return lax.Precision.HIGHEST if dtype == jnp.float32 else None


def dot(a, b, dtype, trans_a=False, trans_b=False):
  """a @ b (either transposed) on `dtype` operands with float32 accumulation."""
  a = a.T if trans_a else a
  b = b.T if trans_b else b
  return jnp.dot(a.astype(dtype), b.astype(dtype), precision=_precision(dtype), preferred_element_type=jnp.float32)


def operand_einsum(spec, a, b, dtype):
  """`jnp.einsum` on `dtype` operands with float32 accumulation (HIGHEST precision when float32). XLA:CPU cannot run
  some bfloat16 dots with a float32 result ("Unsupported element type for DotThunk"): there the rounded operands
  are multiplied as float32, the same products and sums."""
  a, b = a.astype(dtype), b.astype(dtype)
  on = lambda dtype: lambda a, b: jnp.einsum(spec, a.astype(dtype), b.astype(dtype), precision=_precision(dtype),
                                             preferred_element_type=jnp.float32)
  return lax.platform_dependent(a, b, cpu=on(jnp.float32), default=on(dtype))


def call(kernel, grid, in_specs, out_specs, out_shape, interpret, name, num_stages=1, num_warps=4):
  return pl.pallas_call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
                        interpret=interpret, name=name,
                        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages))


def run_length(num_chunks, most):
  """Chunks a program takes: the largest power of 2 up to `most` that divides `num_chunks` (Triton's blocks have
  power-of-2 sides)."""
  per = 1
  while 2 * per <= most and num_chunks % (2 * per) == 0:
    per *= 2
  return per


def run_stages(per):
  """Triton's pipelining stages for a program's loop over its run of `per` chunks (none without a loop)."""
  return RUN_STAGES if per > 1 else 1


class ChunkRef:
  """Chunk `n` of a ref holding a run of chunks at `axis`, indexed as the one-chunk ref would be: a kernel's body
  written for one chunk runs over a program's run unchanged."""

  def __init__(self, ref, n, axis):
    self.ref, self.n, self.axis = ref, n, axis
    self.shape, self.dtype = ref.shape[:axis] + ref.shape[axis + 1:], ref.dtype

  def _at(self, index):
    index = index if isinstance(index, tuple) else (index,)
    ellipsis = [i for i, x in enumerate(index) if x is Ellipsis]
    if ellipsis:
      e = ellipsis[0]
      index = index[:e] + (slice(None),) * (len(self.shape) - len(index) + 1) + index[e + 1:]
    index = index + (slice(None),) * (len(self.shape) - len(index))
    return index[:self.axis] + (self.n,) + index[self.axis:]

  def __getitem__(self, index):
    return self.ref[self._at(index)]

  def __setitem__(self, index, value):
    self.ref[self._at(index)] = value


def over_chunks(kernel, axes):
  """A one-chunk kernel run over its program's run of chunks, in a loop (a run of one: no loop). `axes[i]`: the run's
  axis in the i-th ref."""

  def over_run(*refs):
    chunk = lambda n: kernel(*(ChunkRef(ref, n, axis) for ref, axis in zip(refs, axes, strict=True)))
    per = refs[0].shape[axes[0]]
    if per == 1:
      chunk(0)
      return

    def body(n, carry):
      chunk(n)
      return carry

    lax.fori_loop(0, per, body, 0)

  return over_run


def decay(gamma_r, gamma_s, sees):
  """`gated_delta_chunks.decays` in a kernel: exp(Γ_r − Γ_s) where s sees r, else 0."""
  return jnp.where(sees, jnp.exp(jnp.where(sees, gamma_r[:, None] - gamma_s[None, :], 0.0)), 0.0)


def iotas(size):
  return lax.broadcasted_iota(jnp.int32, (size, size), 0), lax.broadcasted_iota(jnp.int32, (size, size), 1)


def chunk_end(x_C):
  """x's last entry, from a [C] value (Triton indexes refs, not values)."""
  return jnp.sum(jnp.where(lax.broadcasted_iota(jnp.int32, x_C.shape, 0) == x_C.shape[0] - 1, x_C, 0.0))


def write_decays(gamma_C, writes_C):
  """e exp(Γ_C − Γ): how much of each position's key reaches the state leaving the chunk (Kd = K ⊙ this). The state
  passes form Kd from K as they go instead of reading XLA's: on one H100 at 16 × 4096 the forward's loop took 1.59 →
  1.50 ms and XLA's 0.23 ms pass writing Kd went, though the backward's took 2.23 → 2.76 and, at 1 × 65536 (V in
  blocks of 16, each program forming Kd again), the forward's 1.83 → 2.27."""
  return writes_C * jnp.exp(chunk_end(gamma_C) - gamma_C)


def sees_in_chunk(seg_C, diagonal=True):
  """`gated_delta_chunks.sees` of one chunk in a kernel: [C, C], s ≤ r (s < r without the diagonal) in the same
  document."""
  rows_CC, cols_CC = iotas(seg_C.shape[0])
  return (seg_C[:, None] == seg_C[None, :]) & (rows_CC >= cols_CC if diagonal else rows_CC > cols_CC)


def _diagonal_inverses(l_bss):
  """(I + L)⁻¹ of every strictly lower [16, 16] block of [blocks, 16, 16] by forward substitution, the blocks side by
  side: row i of T is e_i − Σ_j L_ij T_j (rows below i are still e_j, and L_ij = 0 there). Each step's two
  reductions cross threads and wait on the step before: the blocks share the 15 steps instead of taking 15 each."""
  rows_bss = lax.broadcasted_iota(jnp.int32, l_bss.shape, 1)
  t_bss = (rows_bss == lax.broadcasted_iota(jnp.int32, l_bss.shape, 2)).astype(jnp.float32)
  for i in range(1, l_bss.shape[1]):
    l_bs = jnp.sum(jnp.where(rows_bss == i, l_bss, 0.0), axis=1)
    t_bss = t_bss - jnp.where(rows_bss == i, jnp.sum(l_bs[:, :, None] * t_bss, axis=1)[:, None, :], 0.0)
  return t_bss


def _inverse_blocks(a, blocks):
  """T = (I + A)⁻¹ in float32 as {(i, j): [16, 16] block} (i ≥ j), from A's blocks a(i, j) (i ≥ j; a(i, i) strictly
  lower). The diagonal blocks by substitution, side by side; those below them by T_ij = −T_ii Σ_{j≤m<i} A_im T_mj
  (exact block inversion: no powers of A, whose entries a Neumann series would let grow)."""
  a_below = {(i, j): a(i, j) for i in range(blocks) for j in range(i)}
  block_bss = lax.broadcasted_iota(jnp.int32, (blocks, BLOCK, BLOCK), 0)
  inverses_bss = _diagonal_inverses(sum(jnp.where(block_bss == b, a(b, b)[None], 0.0) for b in range(blocks)))
  t = {(i, i): jnp.sum(jnp.where(block_bss == i, inverses_bss, 0.0), axis=0) for i in range(blocks)}
  for i in range(1, blocks):
    for j in range(i - 1, -1, -1):
      below = sum(dot(a_below[i, m], t[m, j], jnp.float32) for m in range(j, i))
      t[i, j] = -dot(t[i, i], below, jnp.float32)
  return t


def _chunk_wy_kernel(k_ref, v_ref, beta_ref, gamma_ref, reads_ref, seg_ref, t_ref, u_ref, w_ref, *, dtype):
  """One chunk's T = (I + A)⁻¹ (float32, stored in `dtype`), U = T βV and W = T (K ⊙ β m exp(Γ)), A = strictly lower
  (diag(β) K Kᵀ) ⊙ D, all by blocks of 16 rows (Triton cannot slice a value, only a ref): k_ref [blocks, 16, K],
  v_ref [blocks, 16, V], the per-position refs [blocks, 16], t_ref [blocks, 16, blocks, 16] (block (i, j) at
  [i, :, j, :]), u_ref and w_ref as v_ref and k_ref."""
  blocks = k_ref.shape[0]
  rows_ss, cols_ss = iotas(BLOCK)

  def a(i, j):
    sees = seg_ref[i][:, None] == seg_ref[j][None, :]
    sees = sees & (rows_ss > cols_ss) if i == j else sees
    kk = dot(k_ref[i], k_ref[j], dtype, trans_b=True)
    return kk * beta_ref[i][:, None] * decay(gamma_ref[i], gamma_ref[j], sees)

  t = _inverse_blocks(a, blocks)
  for i in range(blocks):
    for j in range(blocks):
      t_ref[i, :, j, :] = t.get((i, j), jnp.zeros((BLOCK, BLOCK), jnp.float32)).astype(t_ref.dtype)
  bv = lambda j: v_ref[j].astype(jnp.float32) * beta_ref[j][:, None]
  xw = lambda j: k_ref[j].astype(jnp.float32) * (beta_ref[j] * reads_ref[j] * jnp.exp(gamma_ref[j]))[:, None]
  for i in range(blocks):
    u_ref[i] = sum(dot(t[i, j], bv(j), dtype) for j in range(i + 1)).astype(u_ref.dtype)
    w_ref[i] = sum(dot(t[i, j], xw(j), dtype) for j in range(i + 1)).astype(w_ref.dtype)


def takes_the_kernels(chunk_size):
  """Triton's tensors have power-of-2 sides, and the inverse's blocks are 16 wide."""
  return chunk_size >= BLOCK and chunk_size & (chunk_size - 1) == 0


def chunk_wy(k_BGNCK, v_BNCHV, beta_BHNC, gamma_BHNC, reads_BNC, seg_BNC, dtype, interpret):
  """(T, U, W) [B, H, N, C, ·] in `dtype`, U = T βV and W = T (K ⊙ β m exp(Γ)), T = (I + A)⁻¹, A each chunk's
  strictly lower (diag(β) K Kᵀ) ⊙ D, all in one kernel, one program per (row, value head, run of up to WY_CHUNKS
  chunks): from the keys [B, G, N, C, K] and values [B, N, C, H, V] in `dtype`, β and Γ [B, H, N, C] float32, m and
  the documents [B, N, C]. T in float32 inside, rounded to `dtype` where a matmul reads it and where it is stored."""
  b, hk, n, c, k = k_BGNCK.shape
  h, v = v_BNCHV.shape[3:]
  blocks, sq, per = c // BLOCK, pl.squeezed, run_length(n, WY_CHUNKS)
  by_value_head = lambda width: pl.BlockSpec((sq, sq, per, blocks, BLOCK, width),
                                             lambda bi, hi, ni: (bi, hi, ni, 0, 0, 0))
  values = pl.BlockSpec((sq, per, blocks, BLOCK, sq, v), lambda bi, hi, ni: (bi, ni, 0, 0, hi, 0))
  per_position = pl.BlockSpec((sq, sq, per, blocks, BLOCK), lambda bi, hi, ni: (bi, hi, ni, 0, 0))
  per_row_position = pl.BlockSpec((sq, per, blocks, BLOCK), lambda bi, hi, ni: (bi, ni, 0, 0))
  in_specs = [pl.BlockSpec((sq, sq, per, blocks, BLOCK, k), lambda bi, hi, ni: (bi, hi // (h // hk), ni, 0, 0, 0)),
              values, per_position, per_position, per_row_position, per_row_position]
  t_view = (b, h, n, blocks, BLOCK, blocks, BLOCK)
  out_specs = [pl.BlockSpec((sq, sq, per) + t_view[3:], lambda bi, hi, ni: (bi, hi, ni, 0, 0, 0, 0)),
               by_value_head(v), by_value_head(k)]
  out_shape = [jax.ShapeDtypeStruct(t_view, dtype), jax.ShapeDtypeStruct((b, h, n, blocks, BLOCK, v), dtype),
               jax.ShapeDtypeStruct((b, h, n, blocks, BLOCK, k), dtype)]
  by_blocks = lambda x: x.reshape(*x.shape[:3], blocks, BLOCK, *x.shape[4:])
  kernel = over_chunks(functools.partial(_chunk_wy_kernel, dtype=dtype), (0,) * 9)
  t, u, w = call(kernel, (b, h, n // per), in_specs, out_specs, out_shape, interpret, "gated_delta_chunk_wy",
                 run_stages(per))(
                     k_BGNCK.reshape(b, hk, n, blocks, BLOCK, k), v_BNCHV.reshape(b, n, blocks, BLOCK, h, v),
                     by_blocks(beta_BHNC),
                     by_blocks(gamma_BHNC), *(x.reshape(b, n, blocks, BLOCK) for x in (reads_BNC, seg_BNC)))
  return t.reshape(b, h, n, c, c), u.reshape(b, h, n, c, v), w.reshape(b, h, n, c, k)


def _state_forward_kernel(k_ref, gamma_ref, writes_ref, w_ref, u_ref, decay_ref, state_ref, states_ref, vnew_ref,
                          final_ref, *, num_chunks, dtype):
  def chunk(n, s_KJ):
    states_ref[n] = s_KJ.astype(states_ref.dtype)
    vnew_CJ = u_ref[n].astype(jnp.float32) - dot(w_ref[n], s_KJ, dtype)
    vnew_ref[n] = vnew_CJ.astype(vnew_ref.dtype)
    kd_CK = k_ref[n].astype(jnp.float32) * write_decays(gamma_ref[n], writes_ref[n])[:, None]
    return decay_ref[pl.ds(n, 1)] * s_KJ + dot(kd_CK, vnew_CJ, dtype, trans_a=True)

  final_ref[...] = lax.fori_loop(0, num_chunks, chunk, state_ref[...])


def block_v(b, h, v):
  """V columns per state-pass program: BLOCK_V, halved (down to 16) while the grid has under MIN_PROGRAMS."""
  block = min(BLOCK_V, v)
  while b * h * (v // block) < MIN_PROGRAMS and block > 16 and v % (block // 2) == 0:
    block //= 2
  return block


def _specs(n, c, k, r, block):
  """BlockSpecs over the grid (row, value head, block of V) of whole-sequence slices: [B, H, N, C, ·] chunk tensors
  by key columns or by V block, [B, G, N, C, K] ones at the value head's key head (r value heads a key head),
  [B, H, N, C] and [B, N, C] per position, [B, H, N, K, V] per-chunk states, [B, H, N] decays, [B, H, K, V]
  states."""
  sq = pl.squeezed
  return dict(
      chunk_k=pl.BlockSpec((sq, sq, n, c, k), lambda bi, hi, ji: (bi, hi, 0, 0, 0)),
      key_k=pl.BlockSpec((sq, sq, n, c, k), lambda bi, hi, ji: (bi, hi // r, 0, 0, 0)),
      per_head=pl.BlockSpec((sq, sq, n, c), lambda bi, hi, ji: (bi, hi, 0, 0)),
      per_position=pl.BlockSpec((sq, n, c), lambda bi, hi, ji: (bi, 0, 0)),
      chunk_v=pl.BlockSpec((sq, sq, n, c, block), lambda bi, hi, ji: (bi, hi, 0, 0, ji)),
      states=pl.BlockSpec((sq, sq, n, k, block), lambda bi, hi, ji: (bi, hi, 0, 0, ji)),
      decay=pl.BlockSpec((sq, sq, n), lambda bi, hi, ji: (bi, hi, 0)),
      state=pl.BlockSpec((sq, sq, k, block), lambda bi, hi, ji: (bi, hi, 0, ji)))


def state_specs(k_BGNCK, u_BHNCV):
  b, hk, n, c, k = k_BGNCK.shape
  h, v = u_BHNCV.shape[1], u_BHNCV.shape[-1]
  block = block_v(b, h, v)
  return (b, h, v // block), _specs(n, c, k, h // hk, block)


def state_forward(k_BGNCK, gamma_BHNC, writes_BNC, w, u, decay, state, dtype, interpret):
  """The loop over chunks: (S_n [B, H, N, K, V] the state entering each chunk, in `dtype`; V_new [B, H, N, C, V] in
  `dtype`; the final state [B, H, K, V] float32), from the keys [B, G, N, C, K], W [B, H, N, C, K] and U
  [B, H, N, C, V] in `dtype`, Γ [B, H, N, C], e [B, N, C], the decays [B, H, N] and the initial state [B, H, K, V],
  float32."""
  b, h, n, _, k = w.shape
  grid, spec = state_specs(k_BGNCK, u)
  out_shape = [jax.ShapeDtypeStruct((b, h, n, k, u.shape[-1]), dtype), jax.ShapeDtypeStruct(u.shape, dtype),
               jax.ShapeDtypeStruct(state.shape, jnp.float32)]
  kernel = functools.partial(_state_forward_kernel, num_chunks=n, dtype=dtype)
  in_specs = [spec["key_k"], spec["per_head"], spec["per_position"], spec["chunk_k"], spec["chunk_v"],
              spec["decay"], spec["state"]]
  return call(kernel, grid, in_specs, [spec["states"], spec["chunk_v"], spec["state"]], out_shape, interpret,
              "gated_delta_state_forward", STATE_STAGES)(k_BGNCK, gamma_BHNC, writes_BNC, w, u, decay, state)


def _output_kernel(q_ref, k_ref, gamma_ref, reads_ref, seg_ref, states_ref, vnew_ref, o_ref, *, dtype):
  """One chunk's O [C, J] = (Q ⊙ m exp(Γ)) S_n + ((Q Kᵀ) ⊙ D) V_new."""
  gamma_C = gamma_ref[...]
  sees_CC = sees_in_chunk(seg_ref[...])
  q_CK = q_ref[...]
  qd_CK = q_CK.astype(jnp.float32) * (reads_ref[...] * jnp.exp(gamma_C))[:, None]
  p_CC = dot(q_CK, k_ref[...], dtype, trans_b=True) * decay(gamma_C, gamma_C, sees_CC)
  o_ref[...] = (dot(qd_CK, states_ref[...], dtype) + dot(p_CC, vnew_ref[...], dtype)).astype(o_ref.dtype)


def chunk_output(q_BGNCK, k_BGNCK, gamma_BHNC, reads_BNC, seg_BNC, states_BHNKV, vnew_BHNCV, out_dtype, dtype,
                 interpret):
  """O [B, N·C, H, V] in `out_dtype`, each chunk's (Q ⊙ m exp(Γ)) S_n + ((Q Kᵀ) ⊙ D) V_new in one kernel (P never
  leaves it), written straight into the output's layout: from q and k [B, G, N, C, K], Γ [B, H, N, C], m and the
  documents [B, N, C], S_n [B, H, N, K, V] and V_new [B, H, N, C, V]. One program per (row, head, chunk, block of
  up to 128 columns of V)."""
  b, hk, n, c, k = q_BGNCK.shape
  h, v = vnew_BHNCV.shape[1], vnew_BHNCV.shape[-1]
  block, sq = math.gcd(v, 128), pl.squeezed
  per_key_head = pl.BlockSpec((sq, sq, sq, c, k), lambda bi, hi, ni, ji: (bi, hi // (h // hk), ni, 0, 0))
  per_position = pl.BlockSpec((sq, sq, c), lambda bi, hi, ni, ji: (bi, ni, 0))
  in_specs = [per_key_head, per_key_head, pl.BlockSpec((sq, sq, sq, c), lambda bi, hi, ni, ji: (bi, hi, ni, 0)),
              per_position, per_position,
              pl.BlockSpec((sq, sq, sq, k, block), lambda bi, hi, ni, ji: (bi, hi, ni, 0, ji)),
              pl.BlockSpec((sq, sq, sq, c, block), lambda bi, hi, ni, ji: (bi, hi, ni, 0, ji))]
  out_spec = pl.BlockSpec((sq, c, sq, block), lambda bi, hi, ni, ji: (bi, ni, hi, ji))
  return call(functools.partial(_output_kernel, dtype=dtype), (b, h, n, v // block), in_specs, out_spec,
               jax.ShapeDtypeStruct((b, n * c, h, v), out_dtype), interpret, "gated_delta_chunk_output")(
                   q_BGNCK, k_BGNCK, gamma_BHNC, reads_BNC, seg_BNC, states_BHNKV, vnew_BHNCV)
