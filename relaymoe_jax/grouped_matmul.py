"""Grouped-matmul backends and the SwiGLU expert built on them.

No communication. A backend computes out[m] = lhs[m] @ rhs[g(m)] for rows grouped contiguously by group_sizes,
with zeros in rows past sum(group_sizes). Backends:
  xla               `lax.ragged_dot`: runs everywhere; on CPU and (as of JAX 0.11) GPU a dense masked dot.
  xla_scan          a loop over groups: slow, but with a grouped kernel's memory (for memory analysis on CPU).
  mosaic_gpu        JAX's Hopper Mosaic GPU kernels (see `mosaic_gpu.py`), through `kernel_backend`.
  kernel_reference  the `kernel_backend` path with `lax` reference kernels that, like the Mosaic ones, leave
                    garbage past sum(group_sizes): checks the custom_vjp, masking and fallbacks anywhere.
  auto              mosaic_gpu on Hopper GPUs, xla elsewhere.
`kernel_backend` wraps three kernels (forward, input gradient, weight gradient) into a differentiable grouped
matmul, and falls back to `xla` with a logged reason for shapes or dtypes the kernels do not take.
"""

import dataclasses
import functools
import logging
from typing import Callable, Protocol

import jax
import jax.numpy as jnp

from relaymoe_jax.layout import vary_like, varying_axes

log = logging.getLogger(__name__)


class GroupedMatmul(Protocol):

  def __call__(self, lhs_MK, rhs_GKN, group_sizes_G, *, preferred_element_type, precision) -> jax.Array:
    ...


def _xla_ragged_dot(lhs_MK, rhs_GKN, group_sizes_G, *, preferred_element_type, precision):
  return jax.lax.ragged_dot(
      lhs_MK, rhs_GKN, group_sizes_G, precision=precision, preferred_element_type=preferred_element_type)


def _scan_ragged_dot(lhs_MK, rhs_GKN, group_sizes_G, *, preferred_element_type, precision):
  """A loop over groups of masked dense dots: G× the FLOPs of a grouped kernel, but M×N of live memory rather than
  the G×M×N of `lax.ragged_dot`'s dense fallback, so compile-only memory analysis on CPU resembles a GPU kernel's."""
  ends_G = jnp.cumsum(group_sizes_G)
  rows_M = jnp.arange(lhs_MK.shape[0])
  axes = tuple(sorted(set(varying_axes(lhs_MK)) | set(varying_axes(rhs_GKN))))

  def one_group(acc_MN, g):
    in_group = (rows_M >= ends_G[g] - group_sizes_G[g]) & (rows_M < ends_G[g])
    part_MN = jnp.dot(lhs_MK, rhs_GKN[g], precision=precision, preferred_element_type=preferred_element_type)
    return acc_MN + jnp.where(in_group[:, None], part_MN, 0), None

  acc_MN = vary_like(jnp.zeros((lhs_MK.shape[0], rhs_GKN.shape[2]), preferred_element_type), axes)
  return jax.lax.scan(one_group, acc_MN, jnp.arange(rhs_GKN.shape[0]))[0]


@dataclasses.dataclass(frozen=True)
class GroupedKernels:
  """Three grouped-matmul kernels that compute in the inputs' dtype (float32 accumulation inside) and may leave
  anything in rows past sum(group_sizes).

  Attributes:
    forward: (lhs_MK, rhs_GKN, sizes_G) -> out_MN.
    lhs_grad: (d_out_MN, rhs_GKN, sizes_G) -> d_lhs_MK, i.e. d_out @ rhs[g]ᵀ per group.
    rhs_grad: (lhs_MK, d_out_MN, sizes_G) -> d_rhs_GKN, i.e. lhs[rows of g]ᵀ @ d_out[rows of g] (zero if empty).
    unsupported: (m, k, n, dtype) -> None, or the reason these kernels cannot take that shape.
  """

  name: str
  forward: Callable
  lhs_grad: Callable
  rhs_grad: Callable
  unsupported: Callable


def _rows_in_groups(x_M, sizes_G):
  """Zeros in rows past sum(sizes): kernels leave garbage there (NaN would leak into dx)."""
  valid = jnp.arange(x_M.shape[0]) < jnp.sum(sizes_G)
  return jnp.where(valid.reshape((-1,) + (1,) * (x_M.ndim - 1)), x_M, jnp.zeros((), x_M.dtype))


@functools.lru_cache(maxsize=None)
def _kernel_vjp(kernels):
  """The differentiable grouped matmul of one kernel set: forward, then input and weight gradients."""

  @jax.custom_vjp
  def gmm(lhs_MK, rhs_GKN, sizes_G):
    return _rows_in_groups(kernels.forward(lhs_MK, rhs_GKN, sizes_G), sizes_G)

  def gmm_fwd(lhs_MK, rhs_GKN, sizes_G):
    return gmm(lhs_MK, rhs_GKN, sizes_G), (lhs_MK, rhs_GKN, sizes_G)

  def gmm_bwd(residuals, d_out_MN):
    lhs_MK, rhs_GKN, sizes_G = residuals
    d_out_MN = _rows_in_groups(d_out_MN.astype(lhs_MK.dtype), sizes_G)
    d_lhs = _rows_in_groups(kernels.lhs_grad(d_out_MN, rhs_GKN, sizes_G), sizes_G)
    d_rhs = kernels.rhs_grad(lhs_MK, d_out_MN, sizes_G)
    # Kernels come back invariant inside shard_map; cotangents must carry their primal's varying axes.
    return vary_like(d_lhs, varying_axes(lhs_MK)), vary_like(d_rhs, varying_axes(rhs_GKN)), None

  gmm.defvjp(gmm_fwd, gmm_bwd)
  return gmm


@functools.lru_cache(maxsize=None)
def _log_fallback(name, reason):
  log.warning("grouped matmul: %s falls back to xla: %s", name, reason)


def kernel_backend(kernels) -> GroupedMatmul:
  """A backend running `kernels` where they apply and `xla` elsewhere (logged once per reason)."""

  def gmm(lhs_MK, rhs_GKN, group_sizes_G, *, preferred_element_type, precision):
    (m, k), n = lhs_MK.shape, rhs_GKN.shape[2]
    reason = kernels.unsupported(m, k, n, jnp.dtype(lhs_MK.dtype))
    if reason:
      _log_fallback(kernels.name, reason)
      return _xla_ragged_dot(lhs_MK, rhs_GKN, group_sizes_G, preferred_element_type=preferred_element_type,
                             precision=precision)
    axes = tuple(sorted(set(varying_axes(lhs_MK)) | set(varying_axes(rhs_GKN))))
    lhs_MK, rhs_GKN = vary_like(lhs_MK, axes), vary_like(rhs_GKN, axes)
    out = vary_like(_kernel_vjp(kernels)(lhs_MK, rhs_GKN, group_sizes_G.astype(jnp.int32)), axes)
    return out.astype(preferred_element_type)

  return gmm


def _garbage_past_groups(x, sizes_G):
  return jnp.where((jnp.arange(x.shape[0]) < jnp.sum(sizes_G))[:, None], x, jnp.nan)


def _reference_rhs_grad(lhs_MK, d_out_MN, sizes_G):
  dims = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((0,), (0,)), ((), ())),
                                           lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
  return jax.lax.ragged_dot_general(lhs_MK, d_out_MN, sizes_G, dims, precision=jax.lax.Precision.HIGHEST,
                                    preferred_element_type=jnp.float32).astype(lhs_MK.dtype)


def _reference_dot(lhs, rhs, sizes_G):
  out = jax.lax.ragged_dot(lhs, rhs, sizes_G, precision=jax.lax.Precision.HIGHEST,
                           preferred_element_type=jnp.float32)
  return _garbage_past_groups(out.astype(lhs.dtype), sizes_G)


REFERENCE_KERNELS = GroupedKernels(
    name="kernel_reference",
    forward=_reference_dot,
    lhs_grad=lambda d_out, rhs, sizes: _reference_dot(d_out, jnp.swapaxes(rhs, 1, 2), sizes),
    rhs_grad=_reference_rhs_grad,
    unsupported=lambda m, k, n, dtype: (f"k={k} is odd" if k % 2 else None),  # a stand-in constraint to test
)

BACKENDS: dict[str, GroupedMatmul] = {
    "xla": _xla_ragged_dot,
    "xla_scan": _scan_ragged_dot,
    "kernel_reference": kernel_backend(REFERENCE_KERNELS),
}


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
  if name not in BACKENDS and name != "mosaic_gpu":
    raise ValueError(f"unknown grouped-matmul backend {name!r}; known: {sorted([*BACKENDS, 'mosaic_gpu', 'auto'])}")
  return name


def get_backend(name) -> GroupedMatmul:
  name = resolve_backend(name)
  if name == "mosaic_gpu" and name not in BACKENDS:
    from relaymoe_jax import mosaic_gpu  # noqa: PLC0415  (imports Pallas Mosaic GPU: only where it is used)
    BACKENDS[name] = kernel_backend(mosaic_gpu.KERNELS)
  return BACKENDS[name]


# `lax.ragged_dot` without a kernel (XLA:CPU, and XLA:GPU as of JAX 0.11) is a dense masked dot whose temporaries
# are groups × rows × width elements: 64 GiB for one 262144-row hop of 64 experts at D=1024 on one H200. Chunks fed
# to it are capped so that this stays near 2^26 elements.
DENSE_FALLBACK_ELEMENTS = 2**26
ROW_ALIGN = 128


def max_chunk_rows(backend, groups, width):
  """The most rows one grouped-matmul call should get from a chunked caller, or None for no limit."""
  if backend != "xla":  # the others hold M×N at most
    return None
  return max(ROW_ALIGN, DENSE_FALLBACK_ELEMENTS // (groups * width) // ROW_ALIGN * ROW_ALIGN)


def matmul_precision(dtype):
  """float32 runs at full precision (no TF32 on GPU) so the oracle comparison is tight; others use the default."""
  return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


def fuse_gate_up(w_gate_LDF, w_up_LDF):
  """[gate | up] along F, so a hop runs two grouped matmuls forward instead of three. Done once per call, per
  device (under expert tensor parallelism each device pairs its own slices of gate and up)."""
  return jnp.concatenate([w_gate_LDF, w_up_LDF], axis=2)


def split_gate_up(gate_up):
  """Inverse of `fuse_gate_up` along the last axis (weights [L, D, 2F] or activations [R, 2F])."""
  f = gate_up.shape[-1] // 2
  return gate_up[..., :f], gate_up[..., f:]


def _swiglu_activation(gate_up_RG, dtype):
  gate_RF, up_RF = split_gate_up(gate_up_RG)
  return (jax.nn.silu(gate_RF) * up_RF).astype(dtype)


def _matmul_options(dtype):
  return dict(preferred_element_type=jnp.float32, precision=matmul_precision(dtype))


def expert_swiglu(x_RD, w_gate_up_LDG, w_down_LFD, sizes_L, *, backend="xla"):
  """down(silu(x·gate) · (x·up)) for rows grouped by expert, with gate and up fused (G = 2F); float32 result and
  accumulation.

  Returns:
    (y_RD float32, gate_up_RG = x·[gate | up] in x's dtype, for a backward that keeps it).
  """
  gmm = functools.partial(get_backend(backend), **_matmul_options(x_RD.dtype))
  gate_up_RG = gmm(x_RD, w_gate_up_LDG, sizes_L)
  act_RF = _swiglu_activation(gate_up_RG, x_RD.dtype)
  return gmm(act_RF, w_down_LFD, sizes_L), gate_up_RG.astype(x_RD.dtype)


def expert_swiglu_backward(x_RD, w_gate_up_LDG, w_down_LFD, sizes_L, dy_RD, w_R, *, backend="xla",
                           gate_up_RG=None):
  """Gradients of Σ_r w_r · expert_swiglu(x)_r · dy_r, recomputing the intermediates from x (or, given the
  forward's `gate_up_RG`, without the gate and up projections' recompute).

  The down projection's output is never recomputed: with g = dy · W_downᵀ, d(router weight)_r = Σ_F g·act and
  d(act) = w · g, and W_down's gradient is (w · act)ᵀ · dy. So a chunk runs five grouped matmuls (gate+up forward,
  two input gradients, two weight gradients) where autodiff of a recomputed forward runs six; four with
  `gate_up_RG`.

  Returns:
    (dx_RD, dw_R, dw_gate_up_LDG, dw_down_LFD), float32.
  """
  gmm = functools.partial(get_backend(backend), **_matmul_options(x_RD.dtype))
  # With gate_up_RG given, only this product's transposes are used: its forward is dead code that XLA removes.
  recomputed_RG, gate_up_vjp = jax.vjp(lambda x, w: gmm(x, w, sizes_L), x_RD, w_gate_up_LDG)
  gate_RF, up_RF = split_gate_up((recomputed_RG if gate_up_RG is None else gate_up_RG).astype(jnp.float32))
  sigmoid_RF = jax.nn.sigmoid(gate_RF)
  silu_RF = gate_RF * sigmoid_RF
  act_RF = (silu_RF * up_RF).astype(x_RD.dtype)  # as the forward's
  w_R1 = w_R.astype(jnp.float32)[:, None]
  # Only the transposes of this product are used: its forward is dead code that XLA removes.
  _, down_vjp = jax.vjp(lambda a, w: gmm(a, w, sizes_L), (act_RF * w_R1).astype(x_RD.dtype), w_down_LFD)
  g_RF, dw_down_LFD = down_vjp(dy_RD.astype(jnp.float32))
  g_RF = g_RF.astype(jnp.float32)
  dw_R = jnp.sum(g_RF * act_RF.astype(jnp.float32), axis=-1)
  # SwiGLU's derivative by hand, one concatenation: autodiff's transpose of the [gate | up] split is two padded
  # halves added, and XLA computed both halves (sigmoid included) for every element of the result.
  d_act_RF = g_RF * w_R1
  d_gate_up_RG = jnp.concatenate([d_act_RF * up_RF * sigmoid_RF * (1 + gate_RF * (1 - sigmoid_RF)),
                                  d_act_RF * silu_RF], axis=-1)
  dx_RD, dw_gate_up_LDG = gate_up_vjp(d_gate_up_RG)
  return (dx_RD.astype(jnp.float32), dw_R, dw_gate_up_LDG.astype(jnp.float32),
          dw_down_LFD.astype(jnp.float32))
