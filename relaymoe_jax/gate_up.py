"""The layout of an expert's input projection: a gated expert's gate and up fused as [gate | up], a plain expert's
one input matrix as it is.

A hop runs the input projection as one grouped matmul against weights [L, D, U]: U = 2F, [gate | up] along U, for
weights and activations alike; U = F for a plain (two-matrix) expert. Shape letters: see relaymoe_jax.
"""

import jax.numpy as jnp


def join(gate, up):
  """[..., F] and [..., F] → [..., 2F]: weights [L, D, F] (done once per call, per device; under expert tensor
  parallelism each device pairs its own slices of gate and up) or activations [R, F]."""
  return jnp.concatenate([gate, up], axis=-1)


def split(gate_up):
  """Inverse of `join` along the last axis."""
  f = gate_up.shape[-1] // 2
  return gate_up[..., :f], gate_up[..., f:]


def input_weights(w_gate_LDF, w_up_LDF):
  """The input projection's weights [L, D, U]: [gate | up], or a plain expert's input matrix (w_up None)."""
  return w_gate_LDF if w_up_LDF is None else join(w_gate_LDF, w_up_LDF)


def input_weight_grads(dw_in_LDU, gated):
  """(d gate, d up) from the input projection's weight gradient: (d W_in, None) for a plain expert."""
  return split(dw_in_LDU) if gated else (dw_in_LDU, None)
