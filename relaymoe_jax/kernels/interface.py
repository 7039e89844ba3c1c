"""The grouped-matmul interface, its `lax.ragged_dot` backend, and `kernel_backend`: three kernels (forward, input
gradient, weight gradient) made into one differentiable grouped matmul that falls back to `lax.ragged_dot`, with a
logged reason, for shapes or dtypes the kernels do not take; `kernel_swiglu`, the same for a set's gate/up kernel
with SwiGLU in its epilogue (the experts of other activations run the plain kernels, then the activation).

No communication. A grouped matmul computes out[m] = lhs[m] @ rhs[l(m)] for rows grouped contiguously by sizes_L,
with zeros in rows past sum(sizes_L). Below both `grouped_matmul` (the backends by name) and `mosaic_gpu` (one
kernel set). Shape letters: see relaymoe_jax.
"""

import dataclasses
import functools
import logging
from typing import Callable, Protocol

import jax
import jax.numpy as jnp

from relaymoe_jax import activations
from relaymoe_jax.layout import vary_like, varying_axes

log = logging.getLogger(__name__)


class GroupedMatmul(Protocol):

  def __call__(self, lhs_MI, rhs_LIO, sizes_L, *, preferred_element_type, precision) -> jax.Array:
    ...


def xla_ragged_dot(lhs_MI, rhs_LIO, sizes_L, *, preferred_element_type, precision):
  return jax.lax.ragged_dot(lhs_MI, rhs_LIO, sizes_L, precision=precision,
                            preferred_element_type=preferred_element_type)


@dataclasses.dataclass(frozen=True)
class GroupedKernels:
  """Three grouped-matmul kernels that compute in the inputs' dtype (float32 accumulation inside) and may leave
  anything in rows past sum(sizes_L).

  Attributes:
    forward: (lhs_MI, rhs_LIO, sizes_L) -> out_MO.
    lhs_grad: (d_out_MO, rhs_LIO, sizes_L) -> d_lhs_MI, i.e. d_out @ rhs[l]ᵀ per group.
    rhs_grad: (lhs_MI, d_out_MO, sizes_L) -> d_rhs_LIO, i.e. lhs[rows of l]ᵀ @ d_out[rows of l] (zero if empty).
    unsupported: (m, i, o, dtype) -> None, or the reason these kernels cannot take that shape.
    swiglu: (x_MD, w_gate_up_LDU, sizes_L, keep) -> (h_MF, gate_up_MU if keep else None), the gate/up product in
      `gate_up`'s layout with SwiGLU in its epilogue; None: the set has no such kernel.
    swiglu_unsupported: (m, d, u, dtype) -> None, or the reason `swiglu` cannot take that shape.
  """

  name: str
  forward: Callable
  lhs_grad: Callable
  rhs_grad: Callable
  unsupported: Callable
  swiglu: Callable | None = None
  swiglu_unsupported: Callable | None = None


def fill_past_groups(x_M, sizes_L, value):
  """x with `value` in its rows past sum(sizes_L): zeros where kernels left garbage there, NaN where a reference
  stands in for such a kernel."""
  valid = jnp.arange(x_M.shape[0]) < jnp.sum(sizes_L)
  return jnp.where(valid.reshape((-1,) + (1,) * (x_M.ndim - 1)), x_M, jnp.asarray(value, x_M.dtype))


def _rows_in_groups(x_M, sizes_L):
  """Zeros in rows past sum(sizes): kernels leave garbage there (NaN would leak into dx)."""
  return fill_past_groups(x_M, sizes_L, 0)


def _union_of_varying_axes(arrays):
  return tuple(sorted(set().union(*(varying_axes(a) for a in arrays))))


def _vary_alike(*arrays):
  """The arrays typed as varying over the same axes (each one's gradient then has its primal's type)."""
  axes = _union_of_varying_axes(arrays)
  return tuple(vary_like(a, axes) for a in arrays)


def _typed_as_inputs(kernel):
  """`kernel` with its outputs typed as varying over every mesh axis its array inputs vary over. A `pallas_call`'s
  outputs come back invariant inside shard_map whatever its inputs were (Mosaic GPU traces kernels with check_vma
  off), so without this a residual or an output of the custom_vjps below has another type than the cotangents
  autodiff brings it, and `jax.vjp` inside a backward refuses them."""

  def typed(*args):
    axes = _union_of_varying_axes(a for a in args if isinstance(a, jax.Array))
    return jax.tree.map(lambda out: vary_like(out, axes), kernel(*args))

  return typed


@functools.lru_cache(maxsize=None)
def _kernel_vjp(kernels):
  """The differentiable grouped matmul of one kernel set: forward, then input and weight gradients."""
  forward, lhs_grad, rhs_grad = map(_typed_as_inputs, (kernels.forward, kernels.lhs_grad, kernels.rhs_grad))

  @jax.custom_vjp
  def gmm(lhs_MI, rhs_LIO, sizes_L):
    return _rows_in_groups(forward(lhs_MI, rhs_LIO, sizes_L), sizes_L)

  def gmm_fwd(lhs_MI, rhs_LIO, sizes_L):
    return gmm(lhs_MI, rhs_LIO, sizes_L), (lhs_MI, rhs_LIO, sizes_L)

  def gmm_bwd(residuals, d_out_MO):
    lhs_MI, rhs_LIO, sizes_L = residuals
    d_out_MO = _rows_in_groups(d_out_MO.astype(lhs_MI.dtype), sizes_L)
    d_lhs = _rows_in_groups(lhs_grad(d_out_MO, rhs_LIO, sizes_L), sizes_L)
    return d_lhs, rhs_grad(lhs_MI, d_out_MO, sizes_L), None

  gmm.defvjp(gmm_fwd, gmm_bwd)
  return gmm


@functools.lru_cache(maxsize=None)
def _swiglu_vjp(kernels):
  """The SwiGLU kernel made differentiable: its forward also keeps gate|up, from which the backward takes SwiGLU's
  derivative and runs the plain kernels' input and weight gradients."""
  gmm, swiglu = _kernel_vjp(kernels), _typed_as_inputs(kernels.swiglu)

  @jax.custom_vjp
  def gate_up_swiglu(x_MD, w_LDU, sizes_L):
    return _rows_in_groups(swiglu(x_MD, w_LDU, sizes_L, False)[0], sizes_L)

  def gate_up_swiglu_fwd(x_MD, w_LDU, sizes_L):
    h_MF, gate_up_MU = swiglu(x_MD, w_LDU, sizes_L, True)
    return _rows_in_groups(h_MF, sizes_L), (x_MD, w_LDU, sizes_L, gate_up_MU)

  def gate_up_swiglu_bwd(residuals, d_h_MF):
    x_MD, w_LDU, sizes_L, gate_up_MU = residuals
    _, swiglu_vjp = jax.vjp(lambda a: activations.apply(a, "swiglu", jnp.float32), gate_up_MU.astype(jnp.float32))
    (d_gate_up_MU,) = swiglu_vjp(d_h_MF.astype(jnp.float32))
    _, product_vjp = jax.vjp(lambda x, w: gmm(x, w, sizes_L), x_MD, w_LDU)
    return (*product_vjp(d_gate_up_MU.astype(x_MD.dtype)), None)

  gate_up_swiglu.defvjp(gate_up_swiglu_fwd, gate_up_swiglu_bwd)
  return gate_up_swiglu


def kernel_swiglu(kernels):
  """silu(x·gate)·(x·up) for rows grouped by expert (weights in `gate_up`'s layout) on the set's SwiGLU kernel:
  (x_MD, w_gate_up_LDU, sizes_L, keep, activation="swiglu") -> (h_MF, gate_up_MU if keep else None),
  differentiable where not `keep`; or None where the set has no such kernel, or the experts' activation is not
  SwiGLU, or the kernel (or the plain kernels, for the down projection that reads h) cannot take the shape (logged
  once per reason)."""

  def swiglu(x_MD, w_LDU, sizes_L, keep, activation="swiglu"):
    (m, d), u, dtype = x_MD.shape, w_LDU.shape[2], jnp.dtype(x_MD.dtype)
    if kernels.swiglu is None:
      return None
    if activation != "swiglu":
      reason = f"the activation is {activation}, the epilogue's is swiglu"
    else:
      reason = kernels.swiglu_unsupported(m, d, u, dtype) or kernels.unsupported(m, u // 2, d, dtype)
    if reason:
      _log_swiglu_fallback(kernels.name, reason)
      return None
    x_MD, w_LDU, sizes_L = _vary_alike(x_MD, w_LDU, sizes_L.astype(jnp.int32))
    if keep:
      h_MF, gate_up_MU = _typed_as_inputs(kernels.swiglu)(x_MD, w_LDU, sizes_L, True)
      return _rows_in_groups(h_MF, sizes_L), gate_up_MU
    return _swiglu_vjp(kernels)(x_MD, w_LDU, sizes_L), None

  return swiglu


@functools.lru_cache(maxsize=None)
def log_fallback(name, reason):
  log.warning("grouped matmul: %s falls back to xla: %s", name, reason)


@functools.lru_cache(maxsize=None)
def _log_swiglu_fallback(name, reason):
  log.warning("SwiGLU: %s's fused gate/up kernel does not apply (%s); the input projection and the activation "
              "run apart", name, reason)


def kernel_backend(kernels) -> GroupedMatmul:
  """A backend running `kernels` where they apply and `xla` elsewhere (logged once per reason)."""

  def gmm(lhs_MI, rhs_LIO, sizes_L, *, preferred_element_type, precision):
    (m, i), o = lhs_MI.shape, rhs_LIO.shape[2]
    reason = kernels.unsupported(m, i, o, jnp.dtype(lhs_MI.dtype))
    if reason:
      log_fallback(kernels.name, reason)
      return xla_ragged_dot(lhs_MI, rhs_LIO, sizes_L, preferred_element_type=preferred_element_type,
                            precision=precision)
    args = _vary_alike(lhs_MI, rhs_LIO, sizes_L.astype(jnp.int32))
    return _kernel_vjp(kernels)(*args).astype(preferred_element_type)

  return gmm
