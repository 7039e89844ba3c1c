"""The train step compiled from shapes alone, before anything is allocated: its memory per device, and the fit
guard that refuses a step the device cannot hold."""

import concurrent.futures
import math
import os
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import relaymoe_jax as rm
from models.runtime import RuntimeConfig
from models.sharding import batch_spec
from relaymoe_jax.kernels import mosaic_gpu
from train.rundir import preempt
from train.config import RunConfig
from train.data.batches import batch_keys
from train.mesh import check_batch_split, run_mesh
from train.metrics import log_on_process_0, size
from train.sources import model_config_for
from train.step import TrainState, abstract_train_state, make_optimizer, make_train_step

# Locations name an operation's own line, not the stack of the trace that made it: JAX reuses traces it cached, so
# that stack can be another remat policy's compiled before in the process (the planner's). Mosaic GPU kernels embed
# their locations in the program, where the persistent compilation cache's key keeps them: a rerun, compiling only
# the planned step, missed the cache on GPUs.
jax.config.update("jax_include_full_tracebacks_in_locations", False)
mosaic_gpu.stable_kernel_hashes()  # nor their number in the process (jaxlib ≥ 0.11 hashes a counter into each)


def jit_train_step(graphdef, optimizer, schedule, model_config, state_shardings, mesh, runtime, micro_batches=1):
  step = make_train_step(graphdef, optimizer, schedule, model_config, runtime, micro_batches,
                         state_shardings.params)
  return jax.jit(step, donate_argnums=0,
                 out_shardings=(state_shardings, NamedSharding(mesh, P())), compiler_options=rm.COMPILER_OPTIONS)


class CompiledStep(NamedTuple):
  """The train step compiled from shapes alone, before anything is allocated."""

  compiled: jax.stages.Compiled
  graphdef: nnx.GraphDef
  state: TrainState  # ShapeDtypeStructs with the shardings the real state gets
  mesh: jax.sharding.Mesh
  model_config: object  # the family's architecture config
  runtime: RuntimeConfig
  compile_s: float


def compile_step(run_config: RunConfig, devices=None, memory_only=False, *, model_config=None,
                 mesh=None) -> CompiledStep:
  """`devices` (default: all) may be compile-only devices of another machine's topology (`relaymoe-plan
  --topology`): nothing runs. `memory_only`: a step compiled to learn its memory, never run (`MEMORY_ONLY_OPTIONS`).
  `model_config`, `mesh`: the run's, resolved once (`train.run.Run`); without them, made from `run_config`."""
  preempt.check()  # a signal while the trainer plans its step stops it before the next compile
  traced, graphdef, state, mesh, model_config = trace_step(run_config, devices, model_config=model_config, mesh=mesh)
  preempt.check()
  start = time.perf_counter()
  compiled = traced.lower().compile(memory_only_options(devices) if memory_only else None)
  return CompiledStep(compiled, graphdef, state, mesh, model_config, run_config.runtime,
                      time.perf_counter() - start)


# XLA's GPU autotuner times candidate kernels for each matmul fusion on the device while it compiles. Alone that
# costs little, but compiles at once time on the one GPU together: the planner's four uniform steps at once took
# 104-159 s where three without it take 26-42 s (one H200, benchmarks/results/first_step.txt). Which candidate
# wins does not change the buffers (the 4-layer step's bytes within 7 KB), so a step compiled only for its memory
# skips it.
MEMORY_ONLY_OPTIONS = {"xla_gpu_autotune_level": 0}


def memory_only_options(devices=None):
  """Compiler options for a step compiled only for its memory on `devices` (default this process's): none where
  the backend does not autotune (there such a step is the one that runs)."""
  return MEMORY_ONLY_OPTIONS if (devices or jax.devices())[0].platform == "gpu" else None


def concurrent_compiles(devices=None):
  """How many train steps to compile at once: a quarter of the host's cores (compiling one uses several), and one
  for compile-only devices of another machine (`--topology`), whose Mosaic kernels trace under a stand-in for
  `jax.devices` that is not thread-safe."""
  if devices is not None:
    return 1
  return max(1, (os.cpu_count() or 1) // 4)


def at_once(calls, workers):
  """The results of `calls` (functions of no argument that compile), in order, run in up to `workers` threads: XLA
  compiles in C++ without holding the GIL and, for memory only, runs nothing on the device, so compiles at once take
  far less than their sum (on one H200, the three uniform all-to-all 16 × 4096 steps at once in 26 s, one alone in
  15 s). On an error or a stop (`train.rundir.preempt`) the calls not yet started are dropped."""
  workers = min(workers, len(calls))
  if workers < 2:
    return [call() for call in calls]
  pool = concurrent.futures.ThreadPoolExecutor(workers)
  try:
    return [future.result() for future in [pool.submit(call) for call in calls]]
  finally:
    pool.shutdown(cancel_futures=True)


def trace_step(run_config: RunConfig, devices=None, *, model_config=None, mesh=None):
  """(the train step traced from shapes alone, graphdef, abstract state, mesh, model config). `model_config`,
  `mesh`: the run's (`train.run.Run`; its mesh is checked to split this run's batch); without them, made from
  `run_config` (for callers that hold no resolved run)."""
  mesh = run_mesh(run_config, devices) if mesh is None else check_batch_split(run_config, mesh)
  model_config = model_config_for(run_config) if model_config is None else model_config
  optimizer, schedule = make_optimizer(run_config.optim, run_config.steps)
  graphdef, state = abstract_train_state(model_config, run_config.runtime, mesh, optimizer, run_config.seed)
  step_fn = jit_train_step(graphdef, optimizer, schedule, model_config, jax.tree.map(lambda x: x.sharding, state),
                           mesh, run_config.runtime, run_config.micro_batches)
  batch = {key: jax.ShapeDtypeStruct((run_config.batch_size, run_config.seq_len + 1), jnp.int32,
                                    sharding=NamedSharding(mesh, batch_spec(run_config.runtime)))
           for key in batch_keys(run_config.data)}
  return step_fn.trace(state, batch), graphdef, state, mesh, model_config


def memory_plan(run_config: RunConfig, step: CompiledStep | None = None, devices=None):
  """Compiles the train step from shapes alone (no parameter is made) and returns its per-device memory in bytes:
  the training state (parameters and optimizer moments, exact), XLA's compiled temporaries and the total
  (arguments + outputs + temporaries − donated), with the device's allocator limit where it reports one (GPU) and
  the compile time. Whether a configuration fits, before it allocates anything (`relaymoe-train --compile-only`)."""
  step = step or compile_step(run_config, devices)
  limits = [(d.memory_stats() or {}).get("bytes_limit") for d in jax.local_devices()]
  return dict(
      devices=jax.device_count(), mesh=dict(step.mesh.shape), layers=step.model_config.num_hidden_layers,
      batch_size=run_config.batch_size, seq_len=run_config.seq_len, remat=step.runtime.remat,
      compile_s=step.compile_s,
      state_bytes=sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
                      for x in jax.tree.leaves(step.state)),
      temp_bytes=int(step.compiled.memory_analysis().temp_size_in_bytes),
      total_bytes=rm.compiled_bytes(step.compiled), device_limit_bytes=min(limits) if all(limits) else None)


class StepDoesNotFit(RuntimeError):
  """The compiled train step needs more memory per device than the device has."""


def device_limit_bytes(run_config: RunConfig):
  """The memory a step may use per device: `device_memory_gib` if set, else the allocator's limit (GPU), else
  None (CPU devices report none)."""
  if run_config.device_memory_gib:
    return int(run_config.device_memory_gib * 2**30)
  limits = [(d.memory_stats() or {}).get("bytes_limit") for d in jax.local_devices()]
  return min(limits) if all(limits) else None


def check_fits(run_config: RunConfig, step: CompiledStep, suggest=None):
  """Raises StepDoesNotFit, with the numbers (and `suggest(run_config)`: what would fit), when the compiled step's
  bytes exceed the device's limit (`device_memory_gib`, else the allocator's; no limit known: no check)."""
  limit = device_limit_bytes(run_config)
  plan = memory_plan(run_config, step)
  if limit is not None and plan["total_bytes"] > GROWING_ALLOCATOR_SAFE * limit and allocator_grows_on_demand():
    log_on_process_0(
        f"warning: the train step needs {size(plan['total_bytes'])} of the {size(limit)} allowed per device, and "
        "with XLA_PYTHON_CLIENT_PREALLOCATE=false the allocator grows region by region: the step's temporaries "
        f"({size(plan['temp_bytes'])}, one block) may find no contiguous range and fail to allocate. Unset it to "
        "take the memory up front (docs/memory.md).")
  if limit is None or plan["total_bytes"] <= limit:
    return plan
  raise StepDoesNotFit(
      f"the train step needs {size(plan['total_bytes'])} per device (training state {size(plan['state_bytes'])}, "
      f"temporaries {size(plan['temp_bytes'])}) and the device allows {size(limit)}: batch_size="
      f"{run_config.batch_size} seq_len={run_config.seq_len} remat={_remat_name(step.runtime.remat)} "
      f"does not fit." + (f" {suggest(run_config)}" if suggest else ""))


# With the allocator growing on demand, the ring's 4-layer step at 96.6% of an H200's limit failed to allocate its
# temporaries (`capacity` run 5, benchmarks/results/RUNS.md); steps under 90% have not been seen to.
GROWING_ALLOCATOR_SAFE = 0.9


def allocator_grows_on_demand():
  """JAX's GPU allocator without its memory taken up front (XLA_PYTHON_CLIENT_PREALLOCATE=false)."""
  grows = os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "").lower() in ("false", "0")
  return grows and jax.default_backend() == "gpu"


def _remat_name(remat):
  return remat if isinstance(remat, str) else ",".join(remat)
