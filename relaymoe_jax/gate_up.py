"""The fused gate|up layout of a SwiGLU expert, and the activation on it.

A hop runs gate and up as one grouped matmul against weights [L, D, U] (U = 2F): [gate | up] along U, for weights
and activations alike. Shape letters: see relaymoe_jax.
"""

import jax
import jax.numpy as jnp


def join(gate, up):
  """[..., F] and [..., F] → [..., 2F]: weights [L, D, F] (done once per call, per device; under expert tensor
  parallelism each device pairs its own slices of gate and up) or activations [R, F]."""
  return jnp.concatenate([gate, up], axis=-1)


def split(gate_up):
  """Inverse of `join` along the last axis."""
  f = gate_up.shape[-1] // 2
  return gate_up[..., :f], gate_up[..., f:]


def swiglu(gate_up_RU, dtype):
  gate_RF, up_RF = split(gate_up_RU)
  return (jax.nn.silu(gate_RF) * up_RF).astype(dtype)
