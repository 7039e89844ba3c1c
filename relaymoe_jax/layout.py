"""Where tokens and experts live on the mesh, and the small shard_map helpers every dispatcher uses.

No communication of its own. Tokens (dim 0 of x_TD, idx_TK, w_TK) are split over `token_axes`; experts (dim 0 of
every expert weight) over `expert_axis`, which must be one of the token axes so that the ring's devices hold
different tokens. Weights are replicated over the other token axes (data parallel), so their gradients are summed
over those axes. An optional `tensor_axis` (expert tensor parallelism) splits F of every expert; tokens are
replicated over it and partial outputs are summed over it.

Inside a caller's `shard_map` some axes of the mesh are Manual: the arrays are already split over those. A layout
whose axes are all Manual is `per_device`: its arrays are one device's, `place` and `shard_map` leave them as they
are, and E counts the experts of the whole ring. A layout with only some Manual axes runs the block in a
`shard_map` over the others (`free_axes`). Shape letters: see relaymoe_jax.
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


def block_mesh(mesh):
  """The mesh a block call runs on: inside a caller's `shard_map`, the context's (its Manual axes are what says
  the arrays are per device there), which must have `mesh`'s axes if one is given; else `mesh`, or the context's.

  Raises:
    ValueError: a `mesh` whose axes differ from those of the enclosing `shard_map`'s mesh, or no mesh at all.
  """
  context = jax.sharding.get_abstract_mesh()
  if context.empty or not context.manual_axes:
    return context_mesh() if mesh is None else mesh
  if mesh is not None and dict(mesh.shape) != dict(context.shape):
    raise UserError(f"mesh= has axes {dict(mesh.shape)}, but the enclosing shard_map runs on {dict(context.shape)}; "
                    "pass that mesh or leave mesh= out")
  return context


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
  def manual_axes(self):
    """The block's axes that a caller's `shard_map` has already split its arrays over."""
    manual = set(getattr(self.mesh, "manual_axes", ()))
    return tuple(a for a in self.compute_axes if a in manual)

  @property
  def free_axes(self):
    """The block's axes that are not Manual: what its own `shard_map`s split."""
    return tuple(a for a in self.compute_axes if a not in self.manual_axes)

  @property
  def per_device(self):
    """Every axis of the block is Manual: the arrays are one device's."""
    return not self.free_axes

  @property
  def token_shards(self):
    """The shards tokens are split into here (the Manual axes have split them already)."""
    return math.prod(self.mesh.shape[a] for a in self.token_axes if a not in self.manual_axes)

  def num_experts(self, w_gate_EDF):
    """E of the whole ring: inside a `shard_map` over the expert axis the array holds this device's L."""
    return w_gate_EDF.shape[0] * (self.ring_size if self.expert_axis in self.manual_axes else 1)

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
    """Reshards x to spec (over the free axes). Explicit meshes need it before shard_map; Auto meshes let shard_map
    do it."""
    if self.explicit:
      return jax.sharding.reshard(x, NamedSharding(self.mesh, self._free(spec)))
    return x

  def _free(self, spec):
    """spec without the Manual axes, which a caller's `shard_map` has already split."""
    if not self.manual_axes:
      return spec
    kept = [tuple(a for a in ((e,) if isinstance(e, str) else e or ()) if a not in self.manual_axes) for e in spec]
    return P(*(k or None for k in kept))

  def caller_sharding(self, x):
    """x's sharding as its type carries it, for a result to come back with (`restore`): on an Explicit mesh where
    x has one (not an array on no mesh); else None."""
    sharding = jax.typeof(x).sharding
    return sharding if self.explicit and not sharding.mesh.empty else None

  def restore(self, y, sharding, x, out_sharding=None):
    """y sharded as the caller asked (`out_sharding`, a PartitionSpec on this mesh or a NamedSharding), else as x
    came: resharded to `sharding` from `caller_sharding`; on an Auto mesh, where the type carries no sharding, tied
    to x's by XLA's sharding propagation (`shard_alike`). Per device, y is as x is."""
    if out_sharding is not None and self.manual_axes:
      raise UserError(f"out_sharding={out_sharding!r} is not taken inside a shard_map (axes {self.manual_axes} "
                      "Manual): y comes back as x came; set the shard_map's out_specs")
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
    return y if self.explicit or self.manual_axes else shard_alike(x, y)[1]

  def shard_map(self, f, in_specs, out_specs):
    """f per device over the free axes (f itself where there are none: the arrays are one device's already)."""
    if self.per_device:
      return f
    if self.manual_axes:
      free = jax.tree.map(self._free, (in_specs, out_specs), is_leaf=lambda s: isinstance(s, P))
      return jax.shard_map(f, in_specs=free[0], out_specs=free[1], axis_names=set(self.free_axes), check_vma=True)
    return jax.shard_map(f, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=True)


def shard_map_over_free_axes(layout, f, floats, ints, in_specs, out_specs):
  """f(*floats, *ints) in a shard_map over the axes a caller's shard_map left free, differentiable in `floats`
  (arrays or None). Its backward reruns f's forward with f's VJP inside one shard_map, so that no residual crosses
  the nested shard_map: JAX 0.10.2 gives such residuals the parent's Manual axes in their specs too, and XLA
  rejects the program ("operates on axis which is already bound by a parent")."""
  forward = layout.shard_map(f, in_specs, out_specs)
  float_specs = in_specs[:len(floats)]

  def pullback(floats, ints, dy):
    return jax.vjp(lambda *floats: f(*floats, *ints), *floats)[1](dy)

  backward = layout.shard_map(pullback, (float_specs, in_specs[len(floats):], out_specs), float_specs)

  @jax.custom_vjp
  def run(floats, ints):
    return forward(*floats, *ints)

  def run_fwd(floats, ints):
    return run(floats, ints), (floats, ints)

  def run_bwd(residuals, dy):
    return backward(*residuals, dy), None

  run.defvjp(run_fwd, run_bwd)
  return run(tuple(floats), tuple(ints))


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
