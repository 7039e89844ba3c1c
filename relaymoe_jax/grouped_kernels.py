"""The grouped-matmul interface, its `lax.ragged_dot` backend, and `kernel_backend`: three kernels (forward, input
gradient, weight gradient) made into one differentiable grouped matmul that falls back to `lax.ragged_dot`, with a
logged reason, for shapes or dtypes the kernels do not take.

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
  """

  name: str
  forward: Callable
  lhs_grad: Callable
  rhs_grad: Callable
  unsupported: Callable


def fill_past_groups(x_M, sizes_L, value):
  """x with `value` in its rows past sum(sizes_L): zeros where kernels left garbage there, NaN where a reference
  stands in for such a kernel."""
  valid = jnp.arange(x_M.shape[0]) < jnp.sum(sizes_L)
  return jnp.where(valid.reshape((-1,) + (1,) * (x_M.ndim - 1)), x_M, jnp.asarray(value, x_M.dtype))


def _rows_in_groups(x_M, sizes_L):
  """Zeros in rows past sum(sizes): kernels leave garbage there (NaN would leak into dx)."""
  return fill_past_groups(x_M, sizes_L, 0)


@functools.lru_cache(maxsize=None)
def _kernel_vjp(kernels):
  """The differentiable grouped matmul of one kernel set: forward, then input and weight gradients."""

  @jax.custom_vjp
  def gmm(lhs_MI, rhs_LIO, sizes_L):
    return _rows_in_groups(kernels.forward(lhs_MI, rhs_LIO, sizes_L), sizes_L)

  def gmm_fwd(lhs_MI, rhs_LIO, sizes_L):
    return gmm(lhs_MI, rhs_LIO, sizes_L), (lhs_MI, rhs_LIO, sizes_L)

  def gmm_bwd(residuals, d_out_MO):
    lhs_MI, rhs_LIO, sizes_L = residuals
    d_out_MO = _rows_in_groups(d_out_MO.astype(lhs_MI.dtype), sizes_L)
    d_lhs = _rows_in_groups(kernels.lhs_grad(d_out_MO, rhs_LIO, sizes_L), sizes_L)
    d_rhs = kernels.rhs_grad(lhs_MI, d_out_MO, sizes_L)
    # Kernels come back invariant inside shard_map; cotangents must carry their primal's varying axes.
    return vary_like(d_lhs, varying_axes(lhs_MI)), vary_like(d_rhs, varying_axes(rhs_LIO)), None

  gmm.defvjp(gmm_fwd, gmm_bwd)
  return gmm


@functools.lru_cache(maxsize=None)
def log_fallback(name, reason):
  log.warning("grouped matmul: %s falls back to xla: %s", name, reason)


def kernel_backend(kernels) -> GroupedMatmul:
  """A backend running `kernels` where they apply and `xla` elsewhere (logged once per reason)."""

  def gmm(lhs_MI, rhs_LIO, sizes_L, *, preferred_element_type, precision):
    (m, i), o = lhs_MI.shape, rhs_LIO.shape[2]
    reason = kernels.unsupported(m, i, o, jnp.dtype(lhs_MI.dtype))
    if reason:
      log_fallback(kernels.name, reason)
      return xla_ragged_dot(lhs_MI, rhs_LIO, sizes_L, preferred_element_type=preferred_element_type,
                            precision=precision)
    axes = tuple(sorted(set(varying_axes(lhs_MI)) | set(varying_axes(rhs_LIO))))
    lhs_MI, rhs_LIO = vary_like(lhs_MI, axes), vary_like(rhs_LIO, axes)
    out = vary_like(_kernel_vjp(kernels)(lhs_MI, rhs_LIO, sizes_L.astype(jnp.int32)), axes)
    return out.astype(preferred_element_type)

  return gmm
