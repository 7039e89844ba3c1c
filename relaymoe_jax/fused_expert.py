"""The SwiGLU expert of a hop on the fused kernels (`fused_kernels`): the same results as
`grouped_matmul.expert_swiglu` and `expert_swiglu_backward`, but reading x and dy by token index inside the kernels
(no gathered rows), SwiGLU in the gate/up epilogue and its derivative in the down projection's input gradient.

No communication. The down projection's forward and the input gradient of gate/up are plain grouped matmuls on the
backend `grouped_matmul.FUSED_BACKENDS` names, and so is the whole backward where the kernels' `KernelSet.backward`
says they lose there (Triton's). Rows past sum(sizes_L) come back as garbage, for the caller to mask. Shape
letters: see relaymoe_jax.
"""

import functools
import logging

import jax
import jax.numpy as jnp

from relaymoe_jax import fused_kernels
from relaymoe_jax.grouped_matmul import FUSED_BACKENDS, get_backend, matmul_options
from relaymoe_jax.layout import varying_axes, varying_zeros

log = logging.getLogger(__name__)


def is_fused(backend):
  return backend in FUSED_BACKENDS


def _kernels(backend):
  return fused_kernels.REFERENCE if backend == "fused_reference" else fused_kernels.TRITON


def takes(backend, rows, width, ffn, dtype, backward=False):
  """Whether the fused kernels take this chunk (rows × D of `dtype`, experts of FFN width F) in the forward or, with
  `backward`, the backward; else the hop gathers its rows and runs the backend's plain grouped matmuls (logged once
  per reason, not for a backward these kernels leave to the plain path)."""
  kernels = _kernels(backend)
  if backward and not kernels.backward:
    return False
  reason = kernels.unsupported(rows, width, ffn, dtype)
  if reason:
    _log_fallback(backend, reason)
  return reason is None


@functools.lru_cache(maxsize=None)
def _log_fallback(backend, reason):
  log.warning("%s: %s; this chunk runs %s's grouped matmuls on gathered rows", backend, reason,
              FUSED_BACKENDS[backend])


def expert_swiglu(x_TD, tok_R, w_gate_up_LDU, w_down_LFD, sizes_L, *, backend, keep_gate_up=False):
  """(y_RD, gate_up_RU or None) as `grouped_matmul.expert_swiglu` of the rows x[tok_R], gate/up kept only if
  asked."""
  kernels = _kernels(backend)
  outputs = ("h", "gate_up") if keep_gate_up else ("h",)
  tiles = kernels.tiles_for(x_TD.shape[1], w_down_LFD.shape[1], "gate_up_swiglu")
  h_RF, *gate_up = kernels.gate_up_swiglu(x_TD, tok_R, w_gate_up_LDU, sizes_L, outputs=outputs, tiles=tiles)
  y_RD = get_backend(backend)(h_RF, w_down_LFD, sizes_L, **matmul_options(x_TD.dtype))
  return y_RD, (gate_up[0] if gate_up else None)


def expert_swiglu_backward(x_TD, tok_R, w_gate_up_LDU, w_down_LFD, sizes_L, dy_TD, w_R, *, backend,
                           gate_up_RU=None):
  """(dx_RD, dw_R, dw_gate_up_LDU, dw_down_LFD), float32, as `grouped_matmul.expert_swiglu_backward` of the rows
  x[tok_R] and dy[tok_R]: five grouped matmuls (four given the forward's `gate_up_RU`), none on gathered copies."""
  kernels = _kernels(backend)
  up, down, weight = (kernels.tiles_for(x_TD.shape[1], w_down_LFD.shape[1], k) for k in fused_kernels.KERNELS)
  if gate_up_RU is None:
    (gate_up_RU,) = kernels.gate_up_swiglu(x_TD, tok_R, w_gate_up_LDU, sizes_L, outputs=("gate_up",), tiles=up)
  d_gate_up_RU, hw_RF, dw_R = kernels.down_grad(dy_TD, tok_R, w_down_LFD, gate_up_RU, w_R, sizes_L, tiles=down)
  dw_down_LFD = kernels.weight_grad(hw_RF, dy_TD, sizes_L, b_tok_M=tok_R, tiles=weight)
  dw_gate_up_LDU = kernels.weight_grad(x_TD, d_gate_up_RU, sizes_L, a_tok_M=tok_R, tiles=weight)
  # The input gradient's product d_gate_up · W_gate_upᵀ is the plain matmul's transpose; its forward, of zeros, is
  # dead code that XLA removes.
  gmm = functools.partial(get_backend(backend), **matmul_options(x_TD.dtype))
  # The zeros vary as the product does: a primal invariant over an axis would have its cotangent psum'd over it,
  # inside the hop's data-dependent loop (a deadlock where trip counts differ).
  axes = tuple(sorted(set(varying_axes(d_gate_up_RU)) | set(varying_axes(w_gate_up_LDU))))
  zeros_RD = varying_zeros((tok_R.shape[0], x_TD.shape[1]), x_TD.dtype, axes)
  _, input_grad = jax.vjp(lambda x: gmm(x, w_gate_up_LDU, sizes_L), zeros_RD)
  (dx_RD,) = input_grad(d_gate_up_RU.astype(jnp.float32))
  return (dx_RD.astype(jnp.float32), dw_R, dw_gate_up_LDU.astype(jnp.float32),
          dw_down_LFD.astype(jnp.float32))
