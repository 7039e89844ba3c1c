"""Grouped-matmul backends by name, and the expert MLP built on them (`activations`: SwiGLU, GeGLU, GELU, ReLU).

No communication. A backend computes out[m] = lhs[m] @ rhs[l(m)] for rows grouped contiguously by sizes_L, with
zeros in rows past sum(sizes_L) (the interface: `grouped_kernels.GroupedMatmul`). Backends:
  xla               `lax.ragged_dot`: runs everywhere; on CPU and (as of JAX 0.11) GPU a dense masked dot.
  xla_scan          a loop over groups: slow, but with a grouped kernel's memory (for memory analysis on CPU).
  mosaic_gpu        Hopper Mosaic GPU kernels (see `mosaic_gpu.py`), through `grouped_kernels.kernel_backend`, and
                    SwiGLU in the gate/up kernel's epilogue (`grouped_kernels.kernel_swiglu`).
  kernel_reference  the same paths with `lax` reference kernels that, like the Mosaic ones, leave garbage past
                    sum(sizes_L): checks the custom_vjps, masking and fallbacks anywhere.
  auto              mosaic_gpu on Hopper GPUs, xla elsewhere.
Shape letters: see relaymoe_jax.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from relaymoe_jax import activations
from relaymoe_jax.kernels import mosaic_gpu
from relaymoe_jax.errors import UserError
from relaymoe_jax.kernels.interface import (GroupedKernels, GroupedMatmul, fill_past_groups, kernel_backend,
                                          kernel_swiglu, xla_ragged_dot)
from relaymoe_jax.layout import vary_like, varying_axes


def _scan_ragged_dot(lhs_MI, rhs_LIO, sizes_L, *, preferred_element_type, precision):
  """A loop over groups of masked dense dots: L× the FLOPs of a grouped kernel, but M×O of live memory rather than
  the L×M×O of `lax.ragged_dot`'s dense fallback, so compile-only memory analysis on CPU resembles a GPU kernel's."""
  ends_L = jnp.cumsum(sizes_L)
  rows_M = jnp.arange(lhs_MI.shape[0])
  axes = tuple(sorted(set(varying_axes(lhs_MI)) | set(varying_axes(rhs_LIO))))

  def one_group(acc_MO, g):
    in_group = (rows_M >= ends_L[g] - sizes_L[g]) & (rows_M < ends_L[g])
    part_MO = jnp.dot(lhs_MI, rhs_LIO[g], precision=precision, preferred_element_type=preferred_element_type)
    return acc_MO + jnp.where(in_group[:, None], part_MO, 0), None

  acc_MO = vary_like(jnp.zeros((lhs_MI.shape[0], rhs_LIO.shape[2]), preferred_element_type), axes)
  return jax.lax.scan(one_group, acc_MO, jnp.arange(rhs_LIO.shape[0]))[0]


def _as_a_kernel_returns(x):
  """x typed invariant inside shard_map, as a `pallas_call`'s outputs are (Mosaic GPU traces its kernels with
  check_vma off), whatever its inputs varied over: a host callback has the same type and keeps each device's values,
  so the custom_vjps around the kernels meet on CPU the types they meet on a GPU."""
  return jax.pure_callback(np.asarray, jax.ShapeDtypeStruct(x.shape, x.dtype), x)


def _reference_dot(lhs_MI, rhs_LIO, sizes_L):
  out_MO = jax.lax.ragged_dot(lhs_MI, rhs_LIO, sizes_L, precision=jax.lax.Precision.HIGHEST,
                              preferred_element_type=jnp.float32)
  return _as_a_kernel_returns(fill_past_groups(out_MO.astype(lhs_MI.dtype), sizes_L, jnp.nan))


def _reference_lhs_grad(d_out_MO, rhs_LIO, sizes_L):
  return _reference_dot(d_out_MO, jnp.swapaxes(rhs_LIO, 1, 2), sizes_L)


def _reference_rhs_grad(lhs_MI, d_out_MO, sizes_L):
  dims = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((0,), (0,)), ((), ())),
                                           lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
  return _as_a_kernel_returns(jax.lax.ragged_dot_general(
      lhs_MI, d_out_MO, sizes_L, dims, precision=jax.lax.Precision.HIGHEST,
      preferred_element_type=jnp.float32).astype(lhs_MI.dtype))


def _reference_unsupported(m, i, o, dtype):
  return f"I={i} is odd" if i % 2 else None  # a stand-in constraint to test


def _reference_swiglu(x_MD, w_gate_up_LDU, sizes_L, keep):
  gate_up_MU = _reference_dot(x_MD, w_gate_up_LDU, sizes_L)
  return _as_a_kernel_returns(activations.apply(gate_up_MU, "swiglu", x_MD.dtype)), (gate_up_MU if keep else None)


def _reference_swiglu_unsupported(m, d, u, dtype):
  return f"D={d} is not a multiple of 4" if d % 4 else None  # a stand-in constraint to test


REFERENCE_KERNELS = GroupedKernels(name="kernel_reference", forward=_reference_dot, lhs_grad=_reference_lhs_grad,
                                   rhs_grad=_reference_rhs_grad, unsupported=_reference_unsupported,
                                   swiglu=_reference_swiglu, swiglu_unsupported=_reference_swiglu_unsupported)

BACKENDS: dict[str, GroupedMatmul] = {
    "xla": xla_ragged_dot,
    "xla_scan": _scan_ragged_dot,
    "kernel_reference": kernel_backend(REFERENCE_KERNELS),
    "mosaic_gpu": kernel_backend(mosaic_gpu.KERNELS),
}
# Backends with SwiGLU in their gate/up kernel's epilogue (see `grouped_kernels.kernel_swiglu`).
SWIGLU_BACKENDS = {"kernel_reference": kernel_swiglu(REFERENCE_KERNELS),
                   "mosaic_gpu": kernel_swiglu(mosaic_gpu.KERNELS)}


def _hopper(device):
  if device.platform != "gpu":
    return False
  # A compile-only device (`jax.experimental.topologies`) names its kind but has no compute_capability.
  capability = str(getattr(device, "compute_capability", ""))
  return capability.startswith("9") if capability else device.device_kind.startswith(("NVIDIA H100", "NVIDIA H200"))


def resolve_backend(name, mesh=None):
  """'auto' → 'mosaic_gpu' on Hopper GPUs (the mesh's, else this process's), else 'xla'; any other name is checked
  and returned."""
  if name == "auto":
    return "mosaic_gpu" if _hopper(mesh.devices.flat[0] if mesh is not None else jax.devices()[0]) else "xla"
  if name not in BACKENDS:
    raise UserError(f"unknown grouped-matmul backend {name!r}; known: {sorted([*BACKENDS, 'auto'])}")
  return name


def get_backend(name) -> GroupedMatmul:
  return BACKENDS[resolve_backend(name)]


# `lax.ragged_dot` without a kernel (XLA:CPU, and XLA:GPU as of JAX 0.11) is a dense masked dot whose temporaries
# are groups × rows × width elements: 64 GiB for one 262144-row hop of 64 experts at D=1024 on one H200. Chunks fed
# to it are capped so that this stays near 2^26 elements.
DENSE_FALLBACK_ELEMENTS = 2**26
ROW_ALIGN = 128


def max_chunk_rows(backend, groups, width):
  """The most rows one grouped-matmul call should get from a chunked caller, or None for no limit."""
  if backend != "xla":  # the others hold M×O at most
    return None
  return max(ROW_ALIGN, DENSE_FALLBACK_ELEMENTS // (groups * width) // ROW_ALIGN * ROW_ALIGN)


def matmul_precision(dtype):
  """float32 runs at full precision (no TF32 on GPU) so the oracle comparison is tight; others use the default."""
  return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


def matmul_options(dtype):
  return dict(preferred_element_type=jnp.float32, precision=matmul_precision(dtype))


def expert_mlp(x_RD, w_in_LDU, w_down_LFD, sizes_L, *, activation="swiglu", backend="xla", keep_gate_up=False):
  """down(act(x·W_in)) for rows grouped by expert (`activations`: W_in is [gate | up] for gated experts, U = 2F in
  `gate_up`'s layout; a plain expert's input matrix, U = F); float32 result and accumulation. SwiGLU runs in the
  gate/up kernel's epilogue where the backend has one that takes the shape (`SWIGLU_BACKENDS`; other activations
  fall back from it with a logged reason); differentiable unless `keep_gate_up`.

  Returns:
    (y_RD float32, gate_up_RU = x·W_in in x's dtype if `keep_gate_up` (for a backward that keeps it), else None).
  """
  gmm = functools.partial(get_backend(backend), **matmul_options(x_RD.dtype))
  fused = SWIGLU_BACKENDS.get(resolve_backend(backend))
  fused = fused and fused(x_RD, w_in_LDU, sizes_L, keep_gate_up, activation)
  if fused:
    act_RF, gate_up_RU = fused
  else:
    gate_up_RU = gmm(x_RD, w_in_LDU, sizes_L)
    act_RF = activations.apply(gate_up_RU, activation, x_RD.dtype)
  return gmm(act_RF, w_down_LFD, sizes_L), (gate_up_RU.astype(x_RD.dtype) if keep_gate_up else None)


def expert_mlp_backward(x_RD, w_in_LDU, w_down_LFD, sizes_L, dy_RD, w_R, *, activation="swiglu", backend="xla",
                        gate_up_RU=None):
  """Gradients of Σ_r w_r · expert_mlp(x)_r · dy_r, recomputing the intermediates from x (or, given the forward's
  `gate_up_RU`, without the input projection's recompute).

  The down projection's output is never recomputed: with g = dy · W_downᵀ, d(router weight)_r = Σ_F g·act and
  d(act) = w · g, and W_down's gradient is (w · act)ᵀ · dy. So a chunk runs five grouped matmuls (input projection
  forward, two input gradients, two weight gradients) where autodiff of a recomputed forward runs six; four with
  `gate_up_RU`. The activation's derivative: `activations.with_derivative`.

  Returns:
    (dx_RD, dw_R, dw_in_LDU, dw_down_LFD), float32.
  """
  gmm = functools.partial(get_backend(backend), **matmul_options(x_RD.dtype))
  # With gate_up_RU given, only this product's transposes are used: its forward is dead code that XLA removes.
  recomputed_RU, input_vjp = jax.vjp(lambda x, w: gmm(x, w, sizes_L), x_RD, w_in_LDU)
  act_RF, d_input = activations.with_derivative(
      (recomputed_RU if gate_up_RU is None else gate_up_RU).astype(jnp.float32), activation)
  act_RF = act_RF.astype(x_RD.dtype)  # as the forward's
  w_R1 = w_R.astype(jnp.float32)[:, None]
  # Only the transposes of this product are used: its forward is dead code that XLA removes.
  _, down_vjp = jax.vjp(lambda a, w: gmm(a, w, sizes_L), (act_RF * w_R1).astype(x_RD.dtype), w_down_LFD)
  g_RF, dw_down_LFD = down_vjp(dy_RD.astype(jnp.float32))
  g_RF = g_RF.astype(jnp.float32)
  dw_R = jnp.sum(g_RF * act_RF.astype(jnp.float32), axis=-1)
  dx_RD, dw_in_LDU = input_vjp(d_input(g_RF * w_R1))
  return (dx_RD.astype(jnp.float32), dw_R, dw_in_LDU.astype(jnp.float32), dw_down_LFD.astype(jnp.float32))
