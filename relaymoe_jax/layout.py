"""Where tokens and experts live on the mesh, and the small shard_map helpers every dispatcher uses.

No communication of its own. Tokens (dim 0 of x_TD, idx_TK, w_TK) are split over `token_axes`; experts (dim 0 of
every expert weight) over `expert_axis`, which must be one of the token axes so that the ring's devices hold
different tokens. Weights are replicated over the other token axes (data parallel), so their gradients are summed
over those axes. An optional `tensor_axis` (expert tensor parallelism) splits F of every expert; tokens are
replicated over it and partial outputs are summed over it. Shape letters: see relaymoe_jax.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
try:  # JAX 0.10 exports it here, JAX 0.11 does not
  from jax.experimental.shard_alike import shard_alike
except ImportError:
  try:
    from jax._src.shard_alike import shard_alike
  except ImportError:  # y then keeps the sharding XLA gives it

    def shard_alike(x, y):
      return x, y
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from relaymoe_jax.axes import EXPERT
from relaymoe_jax.errors import UserError


def context_mesh():
  """The mesh of the enclosing `jax.set_mesh`: the concrete one outside `jit`, the abstract one inside (where JAX
  gives no other).

  Raises:
    ValueError: when there is none, naming both ways to give one.
  """
  try:
    mesh = jax.sharding.get_mesh()
  except ValueError:  # inside jit: JAX refuses the concrete mesh there
    mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    raise UserError("no mesh: pass mesh= or call under `with jax.set_mesh(mesh):`")
  return mesh


@dataclasses.dataclass(frozen=True)
class ExpertLayout:
  """Mesh and axis roles of one MoE block call. Hashable, so compiled helpers can be cached on it."""

  mesh: jax.sharding.Mesh
  expert_axis: str = EXPERT
  token_axes: tuple[str, ...] = ()
  tensor_axis: str | None = None  # expert tensor parallelism: splits F of every expert

  def __post_init__(self):
    names = tuple(self.mesh.axis_names)
    if self.expert_axis not in names:
      raise UserError(f"expert_axis {self.expert_axis!r} is not an axis of the mesh {names}")
    if not self.token_axes:
      object.__setattr__(self, "token_axes", tuple(a for a in names if a != self.tensor_axis))
    for axis in self.token_axes:
      if axis not in names:
        raise UserError(f"token axis {axis!r} is not an axis of the mesh {names}")
    if self.expert_axis not in self.token_axes:
      raise UserError(f"expert_axis {self.expert_axis!r} must be one of the token axes {self.token_axes}")
    if self.tensor_axis is not None:
      if self.tensor_axis not in names:
        raise UserError(f"tensor_axis {self.tensor_axis!r} is not an axis of the mesh {names}")
      if self.tensor_axis in self.token_axes:
        raise UserError(f"tensor_axis {self.tensor_axis!r} splits expert width and cannot also split tokens "
                        f"(token axes {self.token_axes}); pass token_axes without it")

  def check_sizes(self, num_experts, d_ff):
    """Raises UserError unless the expert axis divides E and the tensor axis F."""
    if num_experts % self.ring_size:
      raise UserError(f"E={num_experts} experts is not divisible by the size {self.ring_size} of expert axis "
                       f"{self.expert_axis!r}")
    if d_ff % self.tensor_size:
      raise UserError(f"F={d_ff} is not divisible by the size {self.tensor_size} of tensor axis "
                       f"{self.tensor_axis!r}")

  @property
  def ring_size(self):
    return self.mesh.shape[self.expert_axis]

  @property
  def token_shards(self):
    return math.prod(self.mesh.shape[a] for a in self.token_axes)

  @property
  def replica_axes(self):
    """Token axes over which expert weights are replicated: weight gradients are summed over these."""
    return tuple(a for a in self.token_axes if a != self.expert_axis)

  @property
  def tensor_size(self):
    return self.mesh.shape[self.tensor_axis] if self.tensor_axis else 1

  @property
  def compute_axes(self):
    """Every axis a device's partial results vary over: the token axes, and the tensor axis under ETP."""
    return self.token_axes + ((self.tensor_axis,) if self.tensor_axis else ())

  @property
  def token_spec(self):
    return P(self.token_axes)

  @property
  def expert_in_spec(self):
    """w_gate_EDF / w_up_EDF: experts over the expert axis, F over the tensor axis."""
    return P(self.expert_axis, None, self.tensor_axis)

  @property
  def expert_out_spec(self):
    """w_down_EFD."""
    return P(self.expert_axis, self.tensor_axis, None)

  @property
  def expert_specs(self):
    return (self.expert_in_spec, self.expert_in_spec, self.expert_out_spec)

  def sum_tensor_partials(self, x):
    """Under expert tensor parallelism each device holds a partial sum over its slice of F."""
    return jax.lax.psum(x, self.tensor_axis) if self.tensor_axis else x

  @property
  def explicit(self):
    return any(t == AxisType.Explicit for t in self.mesh.axis_types)

  def place(self, x, spec):
    """Reshards x to spec. Explicit meshes need it before shard_map; Auto meshes let shard_map do it."""
    if self.explicit:
      return jax.sharding.reshard(x, NamedSharding(self.mesh, spec))
    return x

  def caller_sharding(self, x):
    """x's sharding as its type carries it, for a result to come back with (`restore`): on an Explicit mesh where
    x has one (not an array on no mesh); else None."""
    sharding = jax.typeof(x).sharding
    return sharding if self.explicit and not sharding.mesh.empty else None

  def restore(self, y, sharding, x, out_sharding=None):
    """y sharded as the caller asked (`out_sharding`, a PartitionSpec on this mesh or a NamedSharding), else as x
    came: resharded to `sharding` from `caller_sharding`; on an Auto mesh, where the type carries no sharding, tied
    to x's by XLA's sharding propagation (`shard_alike`)."""
    if out_sharding is not None:
      if isinstance(out_sharding, P):
        out_sharding = NamedSharding(self.mesh, out_sharding)
      if not isinstance(out_sharding, NamedSharding):
        raise UserError(f"out_sharding={out_sharding!r} must be a PartitionSpec or a NamedSharding")
      if self.explicit:
        return jax.sharding.reshard(y, out_sharding)
      return jax.lax.with_sharding_constraint(y, out_sharding)
    if sharding is not None:
      return jax.sharding.reshard(y, sharding)
    return y if self.explicit else shard_alike(x, y)[1]

  def shard_map(self, f, in_specs, out_specs):
    return jax.shard_map(f, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=True)


def varying_zeros(shape, dtype, axes):
  """Zeros typed as varying over `axes`, as shard_map's check_vma wants for loop carries and cotangents."""
  return jax.lax.pcast(jnp.zeros(shape, dtype), tuple(axes), to="varying") if axes else jnp.zeros(shape, dtype)


def varying_axes(x):
  """Mesh axes x varies over inside shard_map (the attribute moved between JAX releases)."""
  aval = jax.typeof(x)
  manual = getattr(aval, "manual_axis_type", None)
  return manual.varying if manual is not None else aval.vma


def vary_like(x, axes):
  """x cast to varying over whichever of `axes` it is not already varying over."""
  missing = tuple(a for a in axes if a not in varying_axes(x))
  return jax.lax.pcast(x, missing, to="varying") if missing else x
