"""`relaymoe-plan`'s search: per dispatcher variant side by side (the run's ring, dropless and capacity-1.0
all-to-all), the plan at the run's shape or the longest sequence / largest batch that fits, compiled for this
machine's devices or for a GPU host it is not (`topology_devices`)."""

import dataclasses
import math
import pathlib

import jax
from jax.experimental import topologies

from models.attention.cudnn import checks_see
from models.sharding import batch_shards
from relaymoe_jax.axes import EXPERT
from relaymoe_jax.errors import MissingInput, UserError
from relaymoe_jax.moe import RINGS
from train.metrics import size
from train.plan.planner import make_planner


# The dispatchers `relaymoe-plan` puts side by side: the run's ring and the two all-to-alls a JAX user has.
VARIANTS = {"ring": None, "a2a_dropless": {}, "a2a_cf1": {"capacity_factor": 1.0}}


def variant_config(run_config, name):
  """The run under one of VARIANTS: `ring` keeps the run's dispatcher if it is a ring (else ring_expert); the
  all-to-alls keep only the grouped-matmul backend of the run's dispatcher options."""
  if name not in VARIANTS:
    raise UserError(f"unknown variant {name!r}; known: {list(VARIANTS)}")
  runtime = run_config.runtime
  if VARIANTS[name] is None:
    ring = runtime.dispatcher if runtime.dispatcher in RINGS else "ring_expert"
    return dataclasses.replace(run_config, runtime=dataclasses.replace(runtime, dispatcher=ring))
  backend = {k: v for k, v in runtime.dispatcher_options if k == "backend"}
  return dataclasses.replace(run_config, runtime=dataclasses.replace(
      runtime, dispatcher="all_to_all", dispatcher_options={**backend, **VARIANTS[name]}))


def search(run, *, maximize=None, granule=None, variants=tuple(VARIANTS), log=print, devices=None,
           upgrade=True):
  """Per variant of `run` (`train.run.Run`: the run config, its model config, its mesh over `devices`): the plan
  at the run's shape, or (maximize="seq") the longest seq_len at one sequence per shard of rows (per token shard;
  under context parallelism per 'data' shard, each sequence spanning 'expert'), or
  (maximize="batch") the largest batch_size at the run's seq_len in one pass, each with its plan; where the run's
  batch_size is larger, the plan for it in the fewest micro-batches that fit (`accumulating`). Returns
  {variant: dict(plan=Plan or None, not_fitting=the smallest size found not to fit)}."""
  results = {}
  run_config, model_config, mesh = run.run_config, run.model_config, run.mesh
  resolved = dict(model_config=model_config, mesh=mesh, log=log, devices=devices)
  shards = batch_shards(mesh, run_config.runtime)
  if run_config.runtime.context_parallel:  # a sequence splits into 2 × expert chunks
    granule = math.lcm(granule or 1024, 2 * mesh.shape[EXPERT])
  configs = {name: variant_config(run_config, name) for name in variants}  # every name checked before a compile
  with checks_see(devices[0] if devices else None):  # compiling for another host's GPUs: cuDNN's checks see them
    for name, config in configs.items():
      results[name] = _search_variant(name, config, run_config, resolved, shards, maximize, granule, upgrade, log)
  return results


def _search_variant(name, config, run_config, resolved, shards, maximize, granule, upgrade, log):
  """One variant's result of `search`."""
  log(f"{name} ({config.runtime.dispatcher}):")
  if maximize == "seq":
    planner = make_planner(dataclasses.replace(config, batch_size=shards, micro_batches=1), **resolved)
    plan, above = planner.maximize("seq_len", granule or 1024, upgrade)
  elif maximize == "batch":
    planner = make_planner(dataclasses.replace(config, micro_batches=1), **resolved)
    plan, above = planner.maximize("batch_size", (granule or 1) * shards, upgrade)
    if plan is not None and run_config.batch_size > plan.batch_size:
      plan = accumulating(planner, run_config.batch_size, plan.batch_size, shards, log) or plan
  else:
    plan, above = make_planner(config, **resolved).plan(), None
  return dict(dispatcher=config.runtime.dispatcher, plan=plan, not_fitting=above,
              options=dict(config.runtime.dispatcher_options))


def accumulating(planner, batch_size, most, shards, log=print, tries=3):
  """The plan of `batch_size` in the fewest micro-batches that fit: micro-batches of at most `most` sequences (the
  largest that fit in one pass), a multiple of `shards`, dividing the batch; each confirmed by compiling the
  accumulating step (its float32 gradient sums take memory too), at most `tries` of them. None where none fits."""
  counts = [m for m in range(-(-batch_size // most), batch_size // shards + 1)
            if not batch_size % m and not (batch_size // m) % shards]
  for m in counts[:tries]:
    log(f"  batch_size={batch_size} does not fit in one pass (at most {most}): trying micro_batches={m}")
    plan = planner.plan(batch_size=batch_size, micro_batches=m)
    if plan.fits:
      return plan
  return None


def render(results, maximize=None):
  """The side-by-side table of `search`'s results (bytes per device), and for each variant where nothing fits what
  to try next."""
  lines = ["| variant | dispatcher | batch | seq_len | remat | state | temporaries | total | budget | fits | "
           "not fitting |", "|---|---|---|---|---|---|---|---|---|---|---|"]
  hints = []
  for name, r in results.items():
    p = r["plan"]
    if p is None:
      lines.append(f"| {name} | {r['dispatcher']} | — | — | nothing fits | | | | | no | {r['not_fitting']} |")
      hints.append(_nothing_fits(name, maximize, r["not_fitting"]))
      continue
    batch = f"{p.batch_size} = {p.micro_batches} × {p.batch_size // p.micro_batches}" if p.micro_batches > 1 else (
        p.batch_size)
    lines.append(f"| {name} | {r['dispatcher']} | {batch} | {p.seq_len} | {p.summary()} | "
                 f"{size(p.state_bytes)} | {size(p.temp_bytes)} | {size(p.total_bytes)} | {size(p.budget_bytes)} | "
                 f"{'yes' if p.fits else 'no'} | {r['not_fitting'] or '—'} |")
    if not p.fits:
      hints.append(_nothing_fits(name, None, None))
  return "\n".join(lines + hints)


def _nothing_fits(name, maximize, smallest):
  if maximize == "seq":
    return (f"{name}: not even seq_len={smallest} fits; --granule N searches in steps of N positions (default "
            "1024), or add devices (mesh.expert) or runtime.context_parallel=true")
  if maximize == "batch":
    return (f"{name}: not even batch_size={smallest} fits at seq_len; lower seq_len, or add devices or "
            "runtime.fsdp=true")
  return (f"{name}: the run's shape does not fit under any remat plan; lower batch_size (or raise micro_batches) "
          "or seq_len, or add devices")


def topology_devices(topology, target_config=None):
  """Compile-only devices of a GPU host this machine is not (`topology` "1x1x8": slices x hosts x GPUs per host,
  of this machine's GPU kind unless `target_config`, a GpuTargetConfigProto text file, says otherwise): the step
  is compiled for them and never run."""
  kwargs = {}
  if target_config:
    try:
      kwargs["target_config"] = pathlib.Path(target_config).read_text()
    except OSError as err:
      raise MissingInput(f"--target-config {target_config}: cannot read it ({err.strerror or err})") from None
  try:
    return topologies.get_topology_desc(platform="cuda", topology=topology, **kwargs).devices
  except NotImplementedError:  # JAX without its CUDA plugin knows no GPU topology
    raise UserError(f"--topology {topology} compiles for GPUs with JAX's CUDA plugin, which is not installed: "
                    f'pip install "jax[cuda12]=={jax.__version__}" (no GPU needed)') from None
