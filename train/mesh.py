"""The run's device mesh ('data' × 'expert' × 'tensor') and the batch placed on it."""

import math

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from models.attention.context_parallel import check_sequence, splits_sequences
from models.sharding import MESH_AXES, TOKEN_AXES, batch_axes, batch_shards, batch_spec
from relaymoe_jax.axes import EXPERT
from relaymoe_jax.errors import UserError


def build_mesh(mesh_config, devices=None):
  devices = list(devices if devices is not None else jax.devices())
  sizes = [getattr(mesh_config, a) for a in MESH_AXES]
  if sizes.count(-1) > 1:
    raise UserError(f"at most one mesh axis may be -1; got {dict(zip(MESH_AXES, sizes))}")
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if len(devices) % known:
      raise UserError(f"{len(devices)} devices cannot be split as {dict(zip(MESH_AXES, sizes))}")
    sizes[sizes.index(-1)] = len(devices) // known
  if math.prod(sizes) != len(devices):
    raise UserError(f"mesh {dict(zip(MESH_AXES, sizes))} needs {math.prod(sizes)} devices; there are "
                    f"{len(devices)}")
  return jax.make_mesh(tuple(sizes), MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)


def token_shards(mesh):
  """How many ways the tokens are split: data × expert (by rows, or under context parallelism by rows over data
  and sequence positions over expert)."""
  return math.prod(mesh.shape[a] for a in TOKEN_AXES)


def run_mesh(run_config, devices=None):
  """The run's mesh, checked to split its batch: each shard of rows (data × expert, or data alone under context
  parallelism) takes whole sequences, and under context parallelism each sequence splits into 2 × expert chunks."""
  return check_batch_split(run_config, build_mesh(run_config.mesh, devices))


def check_batch_split(run_config, mesh):
  """`mesh`, once the run's batch is checked to split over it (`run_mesh`); raises UserError naming what does not."""
  runtime = run_config.runtime
  shards = batch_shards(mesh, runtime)
  if run_config.micro_batch_size % shards:
    over = f"the mesh's {shards} shards of rows ({' × '.join(f'{a}={mesh.shape[a]}' for a in batch_axes(runtime))})"
    if run_config.micro_batches == 1:
      raise UserError(f"batch_size={run_config.batch_size} does not split over {over}: use a multiple of {shards}")
    fitting = [m for m in range(1, run_config.batch_size + 1)
               if run_config.batch_size % m == 0 and (run_config.batch_size // m) % shards == 0]
    raise UserError(f"micro_batches={run_config.micro_batches}: a micro-batch of {run_config.micro_batch_size} "
                    f"sequences (batch_size={run_config.batch_size} / micro_batches) does not split over {over}; "
                    f"micro_batches may be {', '.join(map(str, fitting)) or 'none'} with this batch_size, or "
                    f"batch_size a multiple of {shards * run_config.micro_batches}")
  if splits_sequences(runtime, mesh):
    check_sequence(run_config.seq_len, mesh.shape[EXPERT])
  return mesh


def global_batch(batch, mesh, runtime):
  """The same global numpy batch (a dict of arrays, `train.data.batches.documents`) on every process → global arrays whose
  rows split as the model takes them."""
  sharding = NamedSharding(mesh, batch_spec(runtime))
  return {key: jax.make_array_from_callback(a.shape, sharding, lambda index, a=a: a[index]) for key, a in batch.items()}


def on_mesh(tree, mesh):
  """Every leaf on the mesh: sharded leaves keep their sharding, the rest (step counters) are replicated."""
  replicated = NamedSharding(mesh, P())
  return jax.tree.map(lambda x: x if isinstance(x.sharding, NamedSharding) else jax.device_put(x, replicated), tree)
