"""`MoE` for Flax NNX: router + experts (+ optional shared expert) through `moe_ffn`, x [..., D] in and out.

No communication of its own (`moe_ffn`'s). Each `nnx.Param` carries its sharding as metadata (experts over the
expert axis, F over the tensor axis under expert tensor parallelism), so layers stacked by `nnx.vmap(...,
transform_metadata={nnx.PARTITION_NAME: None})` and run by `nnx.scan` keep a replicated layer axis, and
`nnx.get_partition_spec` gives their shardings. Shape letters: see relaymoe_jax.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from relaymoe_jax.placement import axis_rules
from relaymoe_jax.layers.block import (block_config, check_config, check_experts_split, initializer, moe_block,
                                param_shapes)

__all__ = ["MoE", "axis_rules"]


class MoE(nnx.Module):
  """The MoE block as an NNX layer: `y, aux = MoE(d_model, ..., rngs=rngs)(x)`, y with x's shape, aux an
  `rm.MoEAux`.

  Args:
    d_model: D.
    rngs: `nnx.Rngs` for the parameters.
    param_dtype: of the parameters; init_scale: weights ~ normal · init_scale / sqrt(fan-in).
    kernel_init: instead, a Flax initializer for the router and each expert's matrices (called on one expert's
      [D, F] or [F, D] at a time).
    **block: `BlockConfig`'s fields: num_experts, top_k, d_ff, shared_d_ff, shared_gate, norm_topk_prob, mesh,
      dispatcher, dispatcher_options, expert_axis, token_axes, tensor_axis, dtype, activation.

  Raises:
    ValueError: an unknown argument, top_k out of range, an unknown dispatcher or option, and (where there is a
      mesh) axes it lacks or an E or d_ff it does not divide, named before any parameter is made.
  """

  def __init__(self, d_model, *, rngs, param_dtype=jnp.float32, init_scale=1.0, kernel_init=None, **block):
    self.config = block_config("rm.nnx.MoE", **block)
    check_config(self.config, jax.sharding.get_abstract_mesh() if self.config.mesh is None else self.config.mesh)
    self.names = tuple(param_shapes(self.config, d_model))
    for name, (shape, spec, fan_in) in param_shapes(self.config, d_model).items():
      init = initializer(shape, fan_in, init_scale=init_scale, kernel_init=kernel_init)
      on_mesh = {} if self.config.mesh is None else dict(mesh=self.config.mesh)  # None: the context's
      setattr(self, name, nnx.Param(init(rngs.params(), shape, param_dtype), out_sharding=spec, **on_mesh))

  def __call__(self, x):
    params = {name: getattr(self, name)[...] for name in self.names}
    mesh = jax.sharding.get_abstract_mesh() if self.config.mesh is None else self.config.mesh
    check_experts_split("w_gate_EDF", params["w_gate_EDF"], self.config, mesh)
    return moe_block(self.config, params, x)
