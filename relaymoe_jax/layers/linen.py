"""`MoE` for Flax Linen: router + experts (+ optional shared expert) through `moe_ffn`, x [..., D] in and out.

No communication of its own (`moe_ffn`'s). Parameters are `nn.Partitioned` over the mesh axes (experts over the
expert axis, F over the tensor axis under expert tensor parallelism), so `nn.scan(...,
metadata_params={nn.PARTITION_NAME: None})` stacks them with a replicated layer axis and `nn.get_partition_spec`
gives their shardings. Shape letters: see relaymoe_jax.
"""

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from relaymoe_jax.axes import EXPERT
from relaymoe_jax.placement import axis_rules
from relaymoe_jax.layers.block import (BlockConfig, check_config, check_experts_split, initializer, moe_block,
                                param_shapes)

AUX_NAME = "moe_aux"  # the `sow`n name, in the "intermediates" collection
__all__ = ["AUX_NAME", "MoE", "axis_rules"]


class MoE(nn.Module):
  """The MoE block as a Linen layer: `y, aux = MoE(...)(x)`, y with x's shape, aux an `rm.MoEAux`.

  Also `sow`s aux as "intermediates"/AUX_NAME (apply with `mutable=["intermediates"]` to collect it from every
  layer). Fields are `BlockConfig`'s (sizes, mesh, dispatcher and its options, axis names, compute dtype, the
  experts' activation), plus `param_dtype`, `init_scale` (weights ~ normal · init_scale / sqrt(fan-in)) and
  `kernel_init` (instead: a Flax initializer for the router and each expert's matrices, called on one expert's
  [D, F] or [F, D] at a time).
  """

  num_experts: int
  top_k: int
  d_ff: int
  shared_d_ff: int | None = None
  shared_gate: bool = True
  norm_topk_prob: bool = True
  mesh: Any = None
  dispatcher: Any = "ring_expert"
  dispatcher_options: Any = None
  expert_axis: str = EXPERT
  token_axes: tuple[str, ...] | None = None
  tensor_axis: str | None = None
  dtype: Any = None
  activation: str = "swiglu"
  param_dtype: Any = jnp.float32
  init_scale: float = 1.0
  kernel_init: Any = None

  def block_config(self):
    """The `BlockConfig` of this layer's fields (a Linen module declares its own: it is a dataclass of them)."""
    return BlockConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(BlockConfig)})

  @nn.compact
  def __call__(self, x):
    config = self.block_config()
    params = {}
    mesh = jax.sharding.get_abstract_mesh() if self.mesh is None else self.mesh
    check_config(config, mesh)  # the project's errors, not JAX's when a parameter is placed (a missing axis)
    for name, (shape, spec, fan_in) in param_shapes(config, x.shape[-1]).items():
      init = _placed(initializer(shape, fan_in, init_scale=self.init_scale, kernel_init=self.kernel_init),
                     self.mesh, spec)
      boxed = self.param(name, nn.with_partitioning(init, spec), shape, self.param_dtype, unbox=False)
      if spec[0] == config.expert_axis:  # before unboxing, whose constraint would fail with JAX's own message
        check_experts_split(name, boxed.value if isinstance(boxed, nn.Partitioned) else boxed, config, mesh)
      params[name] = nn.unbox(boxed)
    y, aux = moe_block(config, jax.tree.map(jnp.asarray, params), x)
    self.sow("intermediates", AUX_NAME, aux)
    return y, aux


def _placed(init, mesh, spec):
  """init, its value resharded to spec on an Explicit mesh: Linen's unboxing constrains a parameter to its spec,
  which on Explicit axes is an assertion that it already has it."""
  mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
  if mesh.empty or not any(t == AxisType.Explicit for t in mesh.axis_types):
    return init
  if isinstance(mesh, jax.sharding.Mesh):  # a transfer names the devices, which a `jit` with no mesh context needs
    return lambda key, shape, dtype: jax.device_put(init(key, shape, dtype), NamedSharding(mesh, P(*spec)))
  return lambda key, shape, dtype: jax.sharding.reshard(init(key, shape, dtype), P(*spec))
