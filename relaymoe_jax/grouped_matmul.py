"""Grouped-matmul backends and the SwiGLU expert built on them.

No communication. A backend computes out[m] = lhs[m] @ rhs[g(m)] for rows grouped contiguously by group_sizes;
rows past sum(group_sizes) are unspecified (callers mask them). `xla` is `lax.ragged_dot`, which runs everywhere
(on CPU and, without a kernel, on GPU it is a dense masked dot: G× the work); faster kernels register here.
"""

from typing import Callable, Protocol

import jax
import jax.numpy as jnp


class GroupedMatmul(Protocol):

  def __call__(self, lhs_MK, rhs_GKN, group_sizes_G, *, preferred_element_type, precision) -> jax.Array:
    ...


def _xla_ragged_dot(lhs_MK, rhs_GKN, group_sizes_G, *, preferred_element_type, precision):
  return jax.lax.ragged_dot(
      lhs_MK, rhs_GKN, group_sizes_G, precision=precision, preferred_element_type=preferred_element_type)


BACKENDS: dict[str, GroupedMatmul] = {"xla": _xla_ragged_dot}


def get_backend(name) -> GroupedMatmul:
  if name not in BACKENDS:
    raise ValueError(f"unknown grouped-matmul backend {name!r}; known: {sorted(BACKENDS)}")
  return BACKENDS[name]


# `lax.ragged_dot` without a kernel (XLA:CPU, and XLA:GPU as of JAX 0.11) is a dense masked dot whose temporaries
# are groups × rows × width elements: 64 GiB for one 262144-row hop of 64 experts at D=1024 on one H200. Chunks fed
# to it are capped so that this stays near 2^26 elements.
DENSE_FALLBACK_ELEMENTS = 2**26
ROW_ALIGN = 128


def max_chunk_rows(backend, groups, width):
  """The most rows one grouped-matmul call should get from a chunked caller, or None for no limit."""
  if backend != "xla":
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


def expert_swiglu(x_RD, w_gate_up_LDG, w_down_LFD, sizes_L, *, backend="xla") -> jax.Array:
  """down(silu(x·gate) · (x·up)) for rows grouped by expert, with gate and up fused (G = 2F); float32 result and
  accumulation."""
  gmm: Callable = get_backend(backend)
  kw = dict(preferred_element_type=jnp.float32, precision=matmul_precision(x_RD.dtype))
  gate_RF, up_RF = split_gate_up(gmm(x_RD, w_gate_up_LDG, sizes_L, **kw))
  act_RF = (jax.nn.silu(gate_RF) * up_RF).astype(x_RD.dtype)
  return gmm(act_RF, w_down_LFD, sizes_L, **kw)
