"""The fused gate|up layout of a SwiGLU expert, and the activation on it.

A hop runs gate and up as one grouped matmul against weights [L, D, U] (U = 2F). Along U the columns alternate in
blocks of BLOCK: gate's first BLOCK columns, up's first BLOCK, gate's next, and so on (one block each, i.e. plain
[gate | up], where F is not a multiple of BLOCK). So each output tile of the Hopper kernel (`hopper_grouped`) holds
a gate block and the matching up block, and applies SwiGLU in its epilogue. Weights and activations share the
layout; nothing outside this module reads it. Shape letters: see relaymoe_jax.
"""

import jax
import jax.numpy as jnp

BLOCK = 64


def block_of(ffn):
  return BLOCK if ffn % BLOCK == 0 else ffn


def join(gate, up):
  """[..., F] and [..., F] → [..., 2F] in the fused layout: weights [L, D, F] (done once per call, per device; under
  expert tensor parallelism each device pairs its own slices of gate and up) or activations [R, F]."""
  *lead, f = gate.shape
  b = block_of(f)
  blocks = jnp.stack([gate.reshape(*lead, f // b, b), up.reshape(*lead, f // b, b)], axis=-2)
  return blocks.reshape(*lead, 2 * f)


def split(gate_up):
  """Inverse of `join` along the last axis."""
  *lead, u = gate_up.shape
  f = u // 2
  b = block_of(f)
  blocks = gate_up.reshape(*lead, f // b, 2, b)
  return blocks[..., 0, :].reshape(*lead, f), blocks[..., 1, :].reshape(*lead, f)


def swiglu(gate_up_RU, dtype):
  gate_RF, up_RF = split(gate_up_RU)
  return (jax.nn.silu(gate_RF) * up_RF).astype(dtype)
