"""Where the model's parameters and activations live ("MoE parallel folding": the same devices, a layout per block).

Attention and embeddings split the batch over ('data', 'expert') and heads / MLP width over 'tensor' (parameters
optionally FSDP over ('data', 'expert'), the devices they are replicated on otherwise); the MoE block splits tokens over ('data', 'expert') and experts over 'expert', where
the ring runs. Under context parallelism the batch is split over 'data' and each sequence over 'expert'. Every
parameter's PartitionSpec is in `PARAM_SPECS`, named by its role (shape letters: see `relaymoe_jax`).
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from relaymoe_jax.axes import DATA, EXPERT, TENSOR
from relaymoe_jax.errors import UserError

MESH_AXES = (DATA, EXPERT, TENSOR)
TOKEN_AXES = (DATA, EXPERT)
FSDP = "fsdp"  # placeholder in PARAM_SPECS: the token axes when FSDP is on, else replicated
ETP = "etp"  # placeholder in PARAM_SPECS: TENSOR when expert tensor parallelism is on, else replicated

PARAM_SPECS = {
    "embed_VD": P(None, FSDP),
    "q_DH": P(FSDP, TENSOR), "kv_DG": P(FSDP, TENSOR), "o_HD": P(TENSOR, FSDP),
    "bias_H": P(TENSOR), "head_norm": P(None), "norm_D": P(None),
    "mlp_in_DF": P(FSDP, TENSOR), "mlp_out_FD": P(TENSOR, FSDP),
    "router_DE": P(None, None), "shared_gate_D1": P(FSDP, None),
    "experts_in_EDF": P(EXPERT, None, ETP), "experts_out_EFD": P(EXPERT, ETP, None),
    "lm_head_DV": P(FSDP, TENSOR),
    # Gated DeltaNet (Qwen3.5): replicated over 'tensor' (its heads are not split yet).
    "delta_in_DC": P(FSDP, None), "delta_out_CD": P(None, FSDP), "delta_conv_CW": P(None, None),
    "delta_head_Q": P(None),
}


def batch_axes(runtime):
  """Mesh axes that split a batch's rows: the token axes, or 'data' alone under context parallelism."""
  return (DATA,) if runtime.context_parallel else TOKEN_AXES


def sequence_axis(runtime):
  """The mesh axis that splits each sequence: 'expert' under context parallelism (`models.attention.context_parallel`)."""
  return EXPERT if runtime.context_parallel else None


def batch_spec(runtime):
  """Where a batch of token rows [B, S] enters the model (under context parallelism the model splits each
  sequence itself, in its own order)."""
  return P(batch_axes(runtime), None)


def activation_spec(runtime):
  """Where the model's [B, S, ...] activations live."""
  return P(batch_axes(runtime), sequence_axis(runtime))


def batch_shards(mesh, runtime):
  """How many ways a batch's rows are split."""
  return math.prod(mesh.shape[a] for a in batch_axes(runtime))


def param_spec(role, runtime, mesh=None, shape=None):
  """Where a parameter of `role` lives; with `mesh` and `shape`, a UserError for a split that does not divide the
  dimension it splits (JAX would refuse it only when the parameter is placed, after the step compiled)."""
  placeholders = {FSDP: TOKEN_AXES if runtime.fsdp else None, ETP: TENSOR if runtime.moe_tensor_parallel else None}
  spec = P(*(placeholders.get(a, a) for a in PARAM_SPECS[role]))
  for placeholder, axes, size in zip(PARAM_SPECS[role], spec, shape if mesh is not None else ()):
    axes = (axes,) if isinstance(axes, str) else axes or ()
    ways = math.prod(mesh.shape[a] for a in axes)
    if size % ways:
      raise UserError(f"{SPLIT_BY[placeholder](mesh)} splits the parameter {role} of shape {tuple(shape)} {ways} "
                      f"ways ({' × '.join(axes)}) along a dimension of {size}, which {ways} does not divide")
  return spec


# The setting that makes a PARAM_SPECS entry split a dimension, as the user wrote it.
SPLIT_BY = {FSDP: lambda mesh: "runtime.fsdp=true", ETP: lambda mesh: "runtime.moe_tensor_parallel=true",
            TENSOR: lambda mesh: f"mesh.tensor={mesh.shape[TENSOR]}",
            EXPERT: lambda mesh: f"mesh.expert={mesh.shape[EXPERT]}"}


def make_param(config, runtime, mesh, rngs, role, shape, init="normal"):
  """An `nnx.Param` of `role` (`PARAM_SPECS`) on the model's `mesh`, whichever mesh context the caller is in."""
  initializer = {"ones": nnx.initializers.ones, "zeros": nnx.initializers.zeros, "a_log": _log_uniform(1.0, 16.0)}.get(
      init, nnx.initializers.normal(config.initializer_range))
  spec = tuple(param_spec(role, runtime, mesh, shape))
  key = jax.device_put(rngs.params(), NamedSharding(mesh, P()))  # from a caller's context mesh onto the model's
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):  # where the parameter's sharding constraint is
    return nnx.Param(initializer(key, shape, jnp.dtype(config.param_dtype)), out_sharding=spec, mesh=mesh)


def _log_uniform(low, high):
  """log U(low, high): a Gated DeltaNet's A_log (its decay rates between `low` and `high`)."""
  return lambda key, shape, dtype: jnp.log(jax.random.uniform(key, shape, jnp.float32, low, high)).astype(dtype)


def model_mesh(mesh):
  """The mesh the model places everything on: `mesh`'s devices as ('data', 'expert', 'tensor') with Auto axes.

  An axis `mesh` lacks ('data' or 'tensor') has size 1; a mesh from `jax.make_mesh` (Explicit axes) is taken as the
  same devices with Auto axes, so the model's sharding annotations apply as on any mesh. Raises ValueError for a
  mesh without 'expert' or with an axis of another name.
  """
  names = tuple(mesh.axis_names)
  if EXPERT not in names:
    raise UserError(f"the model needs a mesh with an {EXPERT!r} axis (where the MoE ring runs); got axes {names}")
  unknown = [a for a in names if a not in MESH_AXES]
  if unknown:
    raise UserError(f"mesh axes {unknown} are not the model's; it takes {list(MESH_AXES)} (data and tensor may be "
                    "left out)")
  if names == MESH_AXES and all(t == AxisType.Auto for t in mesh.axis_types):
    return mesh
  devices = np.transpose(mesh.devices, [names.index(a) for a in MESH_AXES if a in names])
  shape = tuple(mesh.shape.get(a, 1) for a in MESH_AXES)
  return Mesh(devices.reshape(shape), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))



def runs_on_model_mesh(method):
  """A model method f(self, *arrays, **arrays) -> (array, pytree) run through `on_model_mesh` on `self.mesh`, its
  array placed as the model's activations (`activation_spec`); arguments given as None stay None."""

  @functools.wraps(method)
  def run(model, *args, **kwargs):
    given = [i for i, a in enumerate(args) if a is not None]
    names = [k for k, a in kwargs.items() if a is not None]

    def on_mesh(*arrays):
      placed = list(args)
      for i, a in zip(given, arrays):
        placed[i] = a
      return method(model, *placed, **dict(kwargs, **dict(zip(names, arrays[len(given):]))))

    return on_model_mesh(model.mesh, on_mesh, activation_spec(model.runtime), *(args[i] for i in given),
                         *(kwargs[k] for k in names))

  return run


def on_model_mesh(mesh, f, spec, *arrays):
  """f(*arrays) with `mesh` (the model's own: `model_mesh`) as the context mesh, whichever one the caller is under
  (`jax.set_mesh`), so the model's sharding constraints and shard_maps agree with it.

  Arrays typed on another mesh (a caller's context, Explicit or Auto) are moved onto `mesh`; f's results, an array
  and a pytree, are moved back onto the caller's context mesh: the array sharded as `spec` (on `mesh`) says
  over the axes that mesh has (its leading entries, for a rank below the spec's), the pytree replicated. With no context and no array typed on another mesh, f
  runs as it is.
  """
  model = mesh.abstract_mesh
  caller = jax.sharding.get_abstract_mesh()
  foreign = [not m.empty and m != model for m in (jax.typeof(a).sharding.mesh for a in arrays)]
  if (caller.empty or caller == model) and not any(foreign):
    return f(*arrays)
  arrays = [jax.device_put(a, NamedSharding(mesh, P())) if moved else a for a, moved in zip(arrays, foreign)]
  with jax.sharding.use_abstract_mesh(model):
    out, aux = f(*arrays)
  if caller.empty or caller == model:
    return out, aux
  target = _concrete_or(caller)
  kept = P(*(_axes_in(entry, caller.axis_names) for entry in tuple(spec)[:out.ndim]))
  aux = jax.tree.map(lambda a: _moved(a, NamedSharding(target, P()), NamedSharding(mesh, P())), aux)
  return _moved(out, NamedSharding(target, kept), NamedSharding(mesh, P(*tuple(spec)[:out.ndim]))), aux


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _moved(x, sharding, back):
  """x moved to `sharding` on another mesh; its cotangent moved `back` (JAX's own transpose of a transfer leaves the
  cotangent typed on the mesh it came from)."""
  return jax.device_put(x, sharding)


def _moved_fwd(x, sharding, back):
  return jax.device_put(x, sharding), None


def _moved_bwd(sharding, back, _, ct):
  return (jax.device_put(ct, back),)


_moved.defvjp(_moved_fwd, _moved_bwd)


def _concrete_or(abstract_mesh):
  """The concrete context mesh outside `jit` (eager transfers need devices), else the abstract one."""
  try:
    return jax.sharding.get_mesh()
  except ValueError:  # inside jit: JAX refuses the concrete mesh there
    return abstract_mesh


def _axes_in(entry, names):
  """A PartitionSpec entry restricted to the axes in `names` (an axis the model has and a mesh lacks is size 1)."""
  axes = tuple(a for a in ((entry,) if isinstance(entry, str) else entry or ()) if a in names)
  return axes[0] if len(axes) == 1 else axes or None
