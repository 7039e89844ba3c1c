"""Dense float32 oracle: every expert applied to every token, masked by the routing. No communication of its own
on global arrays; per device (inside a caller's `shard_map`) it all-gathers the tokens over the token axes and the
experts over the expert axis, and keeps its own rows.

The reference each dispatcher is tested against; it gathers everything to every device, so it is for checking,
not for training. Shape letters: see relaymoe_jax.
"""

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from relaymoe_jax import activations


def dense_moe(x_TD, idx_TK, w_TK, w_gate_EDF, w_up_EDF, w_down_EFD, activation="swiglu"):
  """y = Σ_k w[t,k] · expert_{idx[t,k]}(x[t]), looping over experts in float32 at full precision. An expert is
  down(act(x·gate) · (x·up)) for a gated activation, down(act(x·gate)) for a plain one, whose w_up_EDF is None
  (`activations`)."""
  num_experts = w_gate_EDF.shape[0]
  f32, hi = jnp.float32, jax.lax.Precision.HIGHEST
  act = activations.elementwise(activation)
  x_TD32 = x_TD.astype(f32)
  combine_TE = jnp.sum(jax.nn.one_hot(idx_TK, num_experts, dtype=f32) * w_TK.astype(f32)[..., None], axis=1)

  def one_expert(y_TD, e):
    h_TF = act(jnp.dot(x_TD32, w_gate_EDF[e].astype(f32), precision=hi))
    if w_up_EDF is not None:
      h_TF = h_TF * jnp.dot(x_TD32, w_up_EDF[e].astype(f32), precision=hi)
    out_TD = jnp.dot(h_TF, w_down_EFD[e].astype(f32), precision=hi)
    return y_TD + combine_TE[:, e, None] * out_TD, None

  y_TD, _ = jax.lax.scan(one_expert, jnp.zeros_like(x_TD32), jnp.arange(num_experts))
  return y_TD.astype(x_TD.dtype)


def _dense_per_device(x_TD, idx_TK, w_TK, w_gate_LDF, w_up_LDF, w_down_LFD, *, layout, activation):
  """The oracle on one device's arrays (inside a shard_map): every device's tokens and experts all-gathered, this
  device's rows of the output kept."""
  tokens = [jax.lax.all_gather(a, layout.token_axes, tiled=True) for a in (x_TD, idx_TK, w_TK)]
  experts = [None if w is None else jax.lax.all_gather(w, layout.expert_axis, tiled=True)
             for w in (w_gate_LDF, w_up_LDF, w_down_LFD)]
  y_TD = dense_moe(*tokens, *experts, activation=activation)
  rows = x_TD.shape[0]
  return jax.lax.dynamic_slice_in_dim(y_TD, jax.lax.axis_index(layout.token_axes) * rows, rows)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Dense:
  """The oracle as a dispatcher: inputs are gathered (replicated), the output returns to the token sharding."""

  def __call__(self, x_TD, idx_TK, w_TK, w_gate_EDF, w_up_EDF, w_down_EFD, *, layout, activation="swiglu"):
    if layout.per_device:
      return _dense_per_device(x_TD, idx_TK, w_TK, w_gate_EDF, w_up_EDF, w_down_EFD, layout=layout,
                               activation=activation)
    args = [None if a is None else layout.place(a, P()) for a in (x_TD, idx_TK, w_TK, w_gate_EDF, w_up_EDF,
                                                                   w_down_EFD)]
    return layout.place(dense_moe(*args, activation=activation), layout.token_spec)
