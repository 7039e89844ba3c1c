"""The gated delta rule's state pass as Pallas (Triton) kernels: the sequential part of the chunked form.

`gated_delta` computes every state-independent quantity of a chunk with batched matmuls; what is left is a loop
over chunks carrying the state S [K, V] (`_scan_chunks` there: a `lax.scan` whose every step is a handful of small
XLA kernels). Here one program per (row, value head, block of V columns) keeps its slice of S on chip for the whole
sequence:

  forward, chunk n:  V_new = U − W S,  O = Qd S + P V_new,  S ← d S + Kdᵀ V_new
  backward, n from the last chunk down, carrying dS (the gradient of the state leaving chunk n):
    dV_new = Pᵀ dO + Kd dS,  dQd = dO Sᵀ,  dP = dO V_newᵀ,  dKd = V_new dSᵀ,  dd = Σ S ⊙ dS,
    dU = dV_new,  dW = −dV_new Sᵀ,  dS ← Qdᵀ dO + d dS − Wᵀ dV_new

with S the state entering chunk n, which the forward stores for the backward (N·K·V floats per row and head, what
the `lax.scan`'s own residuals cost). Gradients that sum over V (dQd, dP, dKd, dW, dd) come out per block of V and
are summed by XLA. Elsewhere than on a GPU the kernels run in Pallas' interpreter (the tests' path).

Shape letters here: B rows, H value heads, N chunks, C chunk positions, K key dim, V value dim, J blocks of V.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

BLOCK_V = 64  # V columns per program: S's slice [K, 64] in float32 stays in registers (fla's choice too)


def _dot(a, b, precision, trans_a=False, trans_b=False):
  """a @ b (either transposed) with float32 accumulation; `precision` None: operands in bfloat16 (the tensor
  cores' rate), else float32 at that precision."""
  a = a.T if trans_a else a
  b = b.T if trans_b else b
  if precision is None:
    a, b = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
  return jnp.dot(a, b, precision=precision, preferred_element_type=jnp.float32)


def _forward_kernel(qd_ref, kd_ref, w_ref, p_ref, u_ref, decay_ref, state_ref, o_ref, final_ref, states_ref, *,
                    num_chunks, precision):
  def chunk(n, s_KJ):
    if states_ref is not None:
      states_ref[n] = s_KJ
    vnew_CJ = u_ref[n] - _dot(w_ref[n], s_KJ, precision)
    o_ref[n] = (_dot(qd_ref[n], s_KJ, precision) + _dot(p_ref[n], vnew_CJ, precision)).astype(o_ref.dtype)
    return decay_ref[pl.ds(n, 1)] * s_KJ + _dot(kd_ref[n], vnew_CJ, precision, trans_a=True)

  final_ref[...] = lax.fori_loop(0, num_chunks, chunk, state_ref[...])


def _backward_kernel(qd_ref, kd_ref, w_ref, p_ref, u_ref, decay_ref, states_ref, do_ref, dfinal_ref,
                     dqd_ref, dkd_ref, dw_ref, dp_ref, du_ref, ddecay_ref, dstate_ref, *, num_chunks, precision):
  def chunk(i, ds_KJ):
    n = num_chunks - 1 - i
    s_KJ, do_CJ, decay = states_ref[n], do_ref[n].astype(jnp.float32), decay_ref[pl.ds(n, 1)]
    vnew_CJ = u_ref[n] - _dot(w_ref[n], s_KJ, precision)
    dvnew_CJ = _dot(p_ref[n], do_CJ, precision, trans_a=True) + _dot(kd_ref[n], ds_KJ, precision)
    dqd_ref[n] = _dot(do_CJ, s_KJ, precision, trans_b=True)
    dp_ref[n] = _dot(do_CJ, vnew_CJ, precision, trans_b=True)
    dkd_ref[n] = _dot(vnew_CJ, ds_KJ, precision, trans_b=True)
    ddecay_ref[pl.ds(n, 1)] = jnp.sum(s_KJ * ds_KJ, keepdims=True).reshape(1)
    du_ref[n] = dvnew_CJ
    dw_ref[n] = -_dot(dvnew_CJ, s_KJ, precision, trans_b=True)
    return (_dot(qd_ref[n], do_CJ, precision, trans_a=True) + decay * ds_KJ
            - _dot(w_ref[n], dvnew_CJ, precision, trans_a=True))

  dstate_ref[...] = lax.fori_loop(0, num_chunks, chunk, dfinal_ref[...].astype(jnp.float32))


def _specs(n, c, k, block_v):
  """BlockSpecs over the grid (row, head, block of V): whole-sequence slices of one row and head; `partial` for the
  backward's gradients that sum over V, one per block of V on a leading axis."""
  sq = pl.squeezed
  whole = lambda *tail: pl.BlockSpec((sq, sq, n, *tail), lambda bi, hi, ji: (bi, hi, 0, 0, 0))
  by_v = lambda *tail: pl.BlockSpec((sq, sq, n, *tail), lambda bi, hi, ji: (bi, hi, 0, 0, ji))
  partial = lambda *tail: pl.BlockSpec((sq, sq, sq, n, *tail),
                                       lambda bi, hi, ji: (ji, bi, hi, 0) + (0,) * len(tail))
  return dict(chunk_k=whole(c, k), chunk_c=whole(c, c), chunk_v=by_v(c, block_v), states=by_v(k, block_v),
              decay=pl.BlockSpec((sq, sq, n), lambda bi, hi, ji: (bi, hi, 0)),
              state=pl.BlockSpec((sq, sq, k, block_v), lambda bi, hi, ji: (bi, hi, 0, ji)),
              partial_k=partial(c, k), partial_c=partial(c, c), partial_decay=partial())


def _call(kernel, grid, in_specs, out_specs, out_shape, interpret, name):
  return pl.pallas_call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
                        interpret=interpret, name=name,
                        compiler_params=plt.CompilerParams(num_warps=4, num_stages=1))


def _forward(qd, kd, w, p, u, decay, state, *, precision, save_states, interpret, out_dtype):
  b, h, n, c, k = qd.shape
  v = u.shape[-1]
  block_v = min(BLOCK_V, v)
  spec = _specs(n, c, k, block_v)
  out_shape = [jax.ShapeDtypeStruct((b, h, n, c, v), out_dtype), jax.ShapeDtypeStruct((b, h, k, v), jnp.float32)]
  out_specs = [spec["chunk_v"], spec["state"]]
  if save_states:
    out_shape.append(jax.ShapeDtypeStruct((b, h, n, k, v), jnp.float32))
    out_specs.append(spec["states"])
  kernel = functools.partial(_forward_kernel, num_chunks=n, precision=precision)
  if not save_states:
    kernel = functools.partial(lambda *refs, body: body(*refs, None), body=kernel)
  return _call(kernel, (b, h, v // block_v),
               [spec["chunk_k"], spec["chunk_k"], spec["chunk_k"], spec["chunk_c"], spec["chunk_v"], spec["decay"],
                spec["state"]], out_specs, out_shape, interpret, "gated_delta_state_forward")(
                    qd, kd, w, p, u, decay, state)


def _backward(qd, kd, w, p, u, decay, states, do, dfinal, *, precision, interpret):
  b, h, n, c, k = qd.shape
  v = u.shape[-1]
  block_v = min(BLOCK_V, v)
  j = v // block_v
  spec = _specs(n, c, k, block_v)
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  out_shape = [f32(j, b, h, n, c, k), f32(j, b, h, n, c, k), f32(j, b, h, n, c, k), f32(j, b, h, n, c, c),
               f32(b, h, n, c, v), f32(j, b, h, n), f32(b, h, k, v)]
  out_specs = [spec["partial_k"], spec["partial_k"], spec["partial_k"], spec["partial_c"], spec["chunk_v"],
               spec["partial_decay"], spec["state"]]
  kernel = functools.partial(_backward_kernel, num_chunks=n, precision=precision)
  dqd, dkd, dw, dp, du, ddecay, dstate = _call(
      kernel, (b, h, j), [spec["chunk_k"], spec["chunk_k"], spec["chunk_k"], spec["chunk_c"], spec["chunk_v"],
                          spec["decay"], spec["states"], spec["chunk_v"], spec["state"]],
      out_specs, out_shape, interpret, "gated_delta_state_backward")(qd, kd, w, p, u, decay, states, do, dfinal)
  return dqd.sum(0), dkd.sum(0), dw.sum(0), dp.sum(0), du, ddecay.sum(0), dstate


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def state_pass(qd, kd, w, p, u, decay, state, precision, interpret, out_dtype):
  """(O [B, H, N, C, V] in `out_dtype`, the final state [B, H, K, V] float32) of the chunked form's loop over
  chunks, from the chunk quantities in [B, H, N, ...] order (float32; `decay` [B, H, N]) and the initial state.
  `precision`: None for bfloat16 operands (float32 accumulation, state and decay), else the float32 matmuls'."""
  o, final = _forward(qd, kd, w, p, u, decay, state, precision=precision, save_states=False, interpret=interpret,
                      out_dtype=out_dtype)
  return o, final


def _state_pass_fwd(qd, kd, w, p, u, decay, state, precision, interpret, out_dtype):
  o, final, states = _forward(qd, kd, w, p, u, decay, state, precision=precision, save_states=True,
                              interpret=interpret, out_dtype=out_dtype)
  return (o, final), (qd, kd, w, p, u, decay, states)


def _state_pass_bwd(precision, interpret, out_dtype, residuals, cotangents):
  qd, kd, w, p, u, decay, states = residuals
  do, dfinal = cotangents
  return _backward(qd, kd, w, p, u, decay, states, do, dfinal, precision=precision, interpret=interpret)


state_pass.defvjp(_state_pass_fwd, _state_pass_bwd)
