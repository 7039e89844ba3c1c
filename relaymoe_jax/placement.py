"""Whether the block's arrays are placed as it needs: expert weights split over the expert axis (not every device
holding every expert), and, inside a caller's `shard_map`, each device of the token axes holding tokens of its own.

Raises `UserError` naming the array, the axis and the fix; checks only what is known where it runs (a concrete
array's sharding, an Explicit type's, a Manual axis's varying-ness). No communication. Shape letters: see
relaymoe_jax.
"""

import jax

from relaymoe_jax.axes import EXPERT
from relaymoe_jax.errors import UserError
from relaymoe_jax.layout import varying_axes


def axis_rules(expert_axis=EXPERT, tensor_axis=None):
  """The logical axis rules expert weights need: their partitioning names mesh axes (the expert axis, and the tensor
  axis under expert tensor parallelism), so a model that maps specs through `nn.logical_to_mesh_sharding(specs,
  mesh, rules)` keeps them only where its rules map each name to itself."""
  return tuple((axis, axis) for axis in (expert_axis, tensor_axis) if axis is not None)


def check_experts_split(name, w, *, expert_axis, tensor_axis, mesh):
  """Raises UserError where `w`'s sharding is known (a concrete array, or a traced one on Explicit axes) and does
  not split dim 0 (experts) over the expert axis: every device would hold every expert."""
  if mesh is None or mesh.empty or expert_axis not in mesh.axis_names or mesh.shape[expert_axis] == 1:
    return
  sharding = jax.typeof(w).sharding if isinstance(w, jax.core.Tracer) else getattr(w, "sharding", None)
  if not isinstance(sharding, jax.sharding.NamedSharding) or sharding.mesh.empty or (
      isinstance(w, jax.core.Tracer) and not sharding.mesh.explicit_axes):
    return  # unknown here: a single-device array, or an Auto type inside a trace
  first = tuple(sharding.spec)[0] if len(sharding.spec) else None
  if expert_axis not in ((first,) if isinstance(first, str) else tuple(first or ())):
    raise UserError(
        f"{name} {tuple(w.shape)} is not split over expert axis {expert_axis!r} (its sharding: {sharding.spec}): "
        f"every device would hold all {w.shape[0]} experts. Place it with P({expert_axis!r}, ...); under logical "
        f"axis rules (nn.logical_to_mesh_sharding), add {axis_rules(expert_axis, tensor_axis)} to the rules "
        "(rm.linen.axis_rules(...) gives them)")


def check_per_device(layout, arrays):
  """Inside a caller's `shard_map` (`layout.manual_axes`): tokens vary over every Manual token axis (else devices
  of that axis compute the same tokens and the weight gradients summed over it count them again), expert weights
  over the expert axis where it is Manual (each device its own L experts) and over no Manual data axis (one copy
  per ring, whose gradient is summed over the data axes).

  Args:
    arrays: {name: array or None} of the block's inputs, by `moe_ffn`'s argument names.
  """
  for axis in layout.manual_axes:
    if axis in layout.token_axes and axis not in varying_axes(arrays["x_TD"]):
      raise UserError(
          f"x_TD is replicated over token axis {axis!r} inside your shard_map: each device there would compute the "
          f"same tokens. Split the tokens over it in in_specs, or pass token_axes= without it")
  for name in ("w_gate_EDF", "w_up_EDF", "w_down_EFD"):
    w = arrays[name]
    if w is None:
      continue
    varying = varying_axes(w)
    if layout.expert_axis in layout.manual_axes and layout.ring_size > 1 and layout.expert_axis not in varying:
      raise UserError(
          f"{name} {tuple(w.shape)} is replicated over expert axis {layout.expert_axis!r} inside your shard_map: "
          f"every device holds all {w.shape[0]} experts. Split them over it: in_specs P({layout.expert_axis!r}) "
          f"(each device its {w.shape[0]} // {layout.ring_size})")
    data = sorted(set(layout.replica_axes) & set(varying))
    if data:
      raise UserError(f"{name} {tuple(w.shape)} varies over data axes {data} inside your shard_map: the experts are "
                      "one copy per ring, replicated over the data axes (in_specs without them)")
