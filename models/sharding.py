"""Where the model's parameters and activations live ("MoE parallel folding": the same devices, a layout per block).

Attention and embeddings split the batch over ('data', 'expert') and heads / MLP width over 'tensor' (parameters
optionally FSDP over ('data', 'expert'), the devices they are replicated on otherwise); the MoE block splits tokens over ('data', 'expert') and experts over 'expert', where
the ring runs. Under context parallelism the batch is split over 'data' and each sequence over 'expert'. Every
parameter's PartitionSpec is in `PARAM_SPECS`, named by its role (shape letters: see `relaymoe_jax`).
"""

import math

import numpy as np
from jax.sharding import AxisType, Mesh, PartitionSpec as P

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
}


def batch_axes(runtime):
  """Mesh axes that split a batch's rows: the token axes, or 'data' alone under context parallelism."""
  return (DATA,) if runtime.context_parallel else TOKEN_AXES


def sequence_axis(runtime):
  """The mesh axis that splits each sequence: 'expert' under context parallelism (`models.context_parallel`)."""
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


def param_spec(role, runtime):
  placeholders = {FSDP: TOKEN_AXES if runtime.fsdp else None, ETP: TENSOR if runtime.moe_tensor_parallel else None}
  return P(*(placeholders.get(a, a) for a in PARAM_SPECS[role]))


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
