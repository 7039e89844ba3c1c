"""The training loop: mesh, model, data, the jitted step, one-step-late metrics, checkpoints and logs."""

import dataclasses
import json
import math
import os
import pathlib
import sys
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import relaymoe_jax as rm
from models import qwen3
from relaymoe_jax.axes import DATA, EXPERT, TENSOR
from train.config import RunConfig
from train.convert import initial_params, model_config_from
from train.data import make_source
from train.preempt import StopRequest, Stopped
from train.rundir import RunDirectory, keep_metrics_before
from train.step import TrainState, make_optimizer, make_train_step, model_flops_per_token

MESH_AXES = (DATA, EXPERT, TENSOR)
# Dense bf16 peak per device, for MFU, by device kind.
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}


def build_mesh(mesh_config, devices=None):
  devices = list(devices if devices is not None else jax.devices())
  sizes = [getattr(mesh_config, a) for a in MESH_AXES]
  if sizes.count(-1) > 1:
    raise ValueError(f"at most one mesh axis may be -1; got {dict(zip(MESH_AXES, sizes))}")
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if len(devices) % known:
      raise ValueError(f"{len(devices)} devices cannot be split as {dict(zip(MESH_AXES, sizes))}")
    sizes[sizes.index(-1)] = len(devices) // known
  if math.prod(sizes) != len(devices):
    raise ValueError(f"mesh {dict(zip(MESH_AXES, sizes))} needs {math.prod(sizes)} devices; there are "
                     f"{len(devices)}")
  return jax.make_mesh(tuple(sizes), MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)


def run_mesh(run_config, devices=None):
  """The run's mesh, checked to split its batch: each token shard (data × expert) takes whole sequences."""
  mesh = build_mesh(run_config.mesh, devices)
  shards = math.prod(mesh.shape[a] for a in qwen3.TOKEN_AXES)
  if run_config.batch_size % shards:
    raise ValueError(f"batch_size={run_config.batch_size} does not split over the mesh's {shards} token shards "
                     f"({' × '.join(f'{a}={mesh.shape[a]}' for a in qwen3.TOKEN_AXES)}); use a multiple of {shards}")
  return mesh


def model_overrides_for(run):
  """The run's model-config keys: model_overrides, then the run's dispatcher and remat where set."""
  overrides = dict(run.model_overrides)
  if run.dispatcher:
    overrides["dispatcher"] = run.dispatcher
  if run.remat and run.remat != "auto":  # auto is resolved by `run` (train.plan) before the model is built
    overrides["remat"] = run.remat
  return overrides


def model_config_for(run):
  if run.init_from:
    return model_config_from(run.init_from, model_overrides_for(run))
  return qwen3.load_config(run.model, **model_overrides_for(run))


def dispatch_plan(model_config, run_config, mesh):
  """Both ring modes' per-hop bytes for this run's MoE layers, and which one `auto` runs (logged at start)."""
  if not any(model_config.is_sparse(i) for i in range(model_config.num_hidden_layers)):
    return None
  token_shards = math.prod(mesh.shape[a] for a in qwen3.TOKEN_AXES)
  return rm.plan_dispatch(
      tokens_per_device=run_config.batch_size * run_config.seq_len // token_shards,
      d_model=model_config.hidden_size, d_ff=model_config.moe_intermediate_size,
      num_experts=model_config.num_experts, top_k=model_config.num_experts_per_tok, ring_size=mesh.shape[EXPERT],
      dtype=model_config.dtype, expert_tensor_parallel=mesh.shape[TENSOR] if model_config.moe_tensor_parallel else 1)


def global_batch(tokens, mesh):
  """The same global numpy batch on every process → one global array split over the token axes."""
  sharding = NamedSharding(mesh, P(qwen3.TOKEN_AXES, None))
  return jax.make_array_from_callback(tokens.shape, sharding, lambda index: tokens[index])


def on_mesh(tree, mesh):
  """Every leaf on the mesh: sharded leaves keep their sharding, the rest (step counters) are replicated."""
  replicated = NamedSharding(mesh, P())
  return jax.tree.map(lambda x: x if isinstance(x.sharding, NamedSharding) else jax.device_put(x, replicated), tree)


def host_scalars(metrics):
  """Replicated scalars to Python floats (works when the array is not fully addressable, i.e. multi-process)."""
  return {k: float(np.asarray(v.addressable_data(0))) for k, v in metrics.items()}


class Checkpoints:
  """orbax CheckpointManager: async saves of {state, meta}; a save is atomic (written aside, then renamed), so a
  crash mid-save leaves the previous checkpoint as the latest. A context manager: leaving it waits for the last
  save and closes orbax's threads, on errors too."""

  def __init__(self, directory, keep):
    self.directory = pathlib.Path(directory).absolute()
    self.manager = ocp.CheckpointManager(
        self.directory, item_handlers=dict(state=ocp.StandardCheckpointHandler(), meta=ocp.JsonCheckpointHandler()),
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=True))

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  def save(self, step, state, meta):
    self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                    meta=ocp.args.JsonSave(meta)))

  def latest_step(self):
    return self.manager.latest_step()

  def restore(self, like_state, step=None):
    """(state, meta) of the newest checkpoint that restores into `like_state`'s shapes and shardings (or of
    checkpoint `step`).

    A checkpoint of another layout (layers, sizes, `model.scan_layers`) is an error, read from its metadata before
    any array. A checkpoint whose files do not read (truncated, corrupted) is skipped for the next older one and
    moved aside to `checkpoints-unreadable/`, never deleted, so that this run's saves can take its step again.
    """
    steps = sorted(self.manager.all_steps(), reverse=True)
    if not steps:
      raise FileNotFoundError(f"--resume: no checkpoint in {self.directory}")
    if step is not None:
      if step not in steps:
        raise FileNotFoundError(f"no checkpoint of step {step} in {self.directory}; there are {sorted(steps)}")
      steps = [step]
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), like_state)
    _quiet_closed_event_loops()
    unreadable = []
    for step in steps:
      try:
        restored = self._restore_step(step, abstract)
      except CheckpointUnreadable as err:
        unreadable.append((step, err))
        continue
      self._set_aside(unreadable, step)
      return restored.state, restored.meta
    raise CheckpointUnreadable(f"--resume: no checkpoint in {self.directory} restores: " + "; ".join(
        f"step {step}: {err}" for step, err in unreadable))

  def _restore_step(self, step, abstract):
    try:
      stored = self.manager.item_metadata(step)["state"]
    except (ValueError, KeyError, OSError) as err:
      raise CheckpointUnreadable(f"its metadata does not read ({_first_line(err)})") from err
    if stored is None:
      raise CheckpointUnreadable("it has no training state")
    if _leaf_shapes(stored) != _leaf_shapes(abstract):
      # Checked before orbax reads any array: a read of the wrong shape fails inside tensorstore and floods stderr.
      raise ValueError(f"--resume: checkpoint step {step} in {self.directory} does not fit this model's "
                       "parameters (another model config: layers, sizes, or model.scan_layers, which stacks layers); "
                       f"{_layout_difference(_leaf_shapes(stored), _leaf_shapes(abstract))}")
    try:
      return self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                                meta=ocp.args.JsonRestore()))
    except (ValueError, KeyError, OSError) as err:  # the layout matched: its files are what is wrong
      raise CheckpointUnreadable(f"it does not read ({_first_line(err)})") from err

  def _set_aside(self, unreadable, good_step):
    """Moves the unreadable checkpoints out of orbax's sight (process 0; all processes then see it) and says so."""
    if not unreadable:
      return
    aside = self.directory.parent / "checkpoints-unreadable"
    for step, err in unreadable:
      target = aside / str(step)
      if jax.process_index() == 0:
        aside.mkdir(exist_ok=True)
        while target.exists():
          target = target.with_name(target.name + "+")
        (self.directory / str(step)).rename(target)
        print(f"--resume: skipped checkpoint step {step}: {err}; moved it to {target} (kept) and resuming from "
              f"step {good_step}", file=sys.stderr, flush=True)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices("relaymoe: unreadable checkpoints set aside")
    self.manager.reload()

  def close(self):
    if self.manager is None:
      return
    manager, self.manager = self.manager, None
    manager.wait_until_finished()
    manager.close()


class CheckpointUnreadable(RuntimeError):
  """A checkpoint's files do not read (truncated, corrupted, missing)."""


def _first_line(err):
  return (str(err).strip().splitlines() or [type(err).__name__])[0][:300]


def _leaf_shapes(tree):
  """{'opt_state.1.0.mu.embed_VD': shape} for every array: the same keys for a saved tree's metadata (dicts and
  lists) and the live one (named tuples, tuples)."""
  def name(key):
    return str(getattr(key, "key", getattr(key, "idx", getattr(key, "name", key))))
  return {".".join(name(k) for k in path): tuple(leaf.shape) for path, leaf in jax.tree_util.tree_leaves_with_path(
      tree, is_leaf=lambda x: hasattr(x, "shape"))}


def _layout_difference(stored, wanted):
  only_stored, only_wanted = sorted(set(stored) - set(wanted)), sorted(set(wanted) - set(stored))
  if only_stored or only_wanted:
    return (f"the checkpoint has {len(only_stored)} arrays this model lacks (first: {only_stored[:2]}) and lacks "
            f"{len(only_wanted)} it has (first: {only_wanted[:2]})")
  key = next(k for k in sorted(stored) if stored[k] != wanted[k])
  return f"{key} is {stored[key]} in the checkpoint and {wanted[key]} in this model"


def _quiet_closed_event_loops():
  """When one read of a checkpoint fails, orbax closes its event loop with reads still in flight, and each of
  tensorstore's late callbacks prints an 'Event loop is closed' traceback (hundreds, burying the real error):
  drop those, and only those, from then on."""
  previous = sys.unraisablehook
  if getattr(previous, "relaymoe_quiet", False):
    return

  def hook(unraisable):
    if not (isinstance(unraisable.exc_value, RuntimeError) and "Event loop is closed" in str(unraisable.exc_value)):
      previous(unraisable)

  hook.relaymoe_quiet = True
  sys.unraisablehook = hook


class MetricsLog:
  """metrics.jsonl (every logged step), TensorBoard, and a progress bar; only process 0 writes."""

  def __init__(self, out_dir, total_steps, start_step, tensorboard):
    self.active = jax.process_index() == 0
    self.path = pathlib.Path(out_dir) / "metrics.jsonl"
    self.writer = self.bar = None
    if not self.active:
      return
    self.path.parent.mkdir(parents=True, exist_ok=True)
    keep_metrics_before(self.path, start_step)
    if tensorboard:
      from tensorboardX import SummaryWriter  # noqa: PLC0415  (only the writing process needs it)
      self.writer = SummaryWriter(str(pathlib.Path(out_dir) / "tensorboard"))
    from tqdm import tqdm  # noqa: PLC0415
    self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)

  def write(self, record):
    if not self.active:
      return
    with self.path.open("a") as fh:
      fh.write(json.dumps(record) + "\n")
    if self.writer:
      for key, value in record.items():
        if key != "step" and isinstance(value, (int, float)):
          self.writer.add_scalar(key, value, record["step"])
    postfix = dict(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}",
                   tflops_dev=f"{record['tflops_per_device']:.3g}",
                   mem_gib=f"{record['peak_memory_bytes'] / 2**30:.2f}")
    if record.get("mfu") is not None:
      postfix["mfu"] = f"{record['mfu']:.1%}"
    self.bar.set_postfix(postfix, refresh=False)

  def advance(self):
    if self.bar:
      self.bar.update(1)

  def close(self):
    if self.writer:
      self.writer.close()
    if self.bar:
      self.bar.close()


def peak_memory_bytes(compiled):
  """Peak device memory so far from the allocator where it reports one (GPU); else XLA's compiled estimate of the
  train step (`rm.compiled_bytes`)."""
  stats = [d.memory_stats() or {} for d in jax.local_devices()]
  peaks = [s["peak_bytes_in_use"] for s in stats if "peak_bytes_in_use" in s]
  return max(peaks) if peaks else rm.compiled_bytes(compiled)


def _peak_tflops(run):
  if run.peak_tflops_per_device:
    return run.peak_tflops_per_device
  kind = jax.devices()[0].device_kind
  return next((v for k, v in PEAK_TFLOPS.items() if k in kind), None)


def jit_train_step(graphdef, optimizer, schedule, model_config, state_shardings, mesh):
  return jax.jit(make_train_step(graphdef, optimizer, schedule, model_config), donate_argnums=0,
                 out_shardings=(state_shardings, NamedSharding(mesh, P())), compiler_options=rm.COMPILER_OPTIONS)


def abstract_train_state(model_config, mesh, optimizer, seed=0):
  """(graphdef, the TrainState as ShapeDtypeStructs with the shardings `run` gives the real one): nothing is
  allocated. Optimizer moments take their parameter's sharding (as the eager init does), counters replicate."""
  graphdef, state = qwen3.abstract(model_config, mesh, seed)
  params = nnx.to_pure_dict(state)
  param_shardings = {jax.tree_util.keystr(path): p.sharding for path, p in jax.tree_util.tree_leaves_with_path(params)}
  replicated = NamedSharding(mesh, P())

  def like_its_parameter(path, leaf):
    key = jax.tree_util.keystr(path)
    owner = max((p for p in param_shardings if key.endswith(p)), key=len, default=None)
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=param_shardings[owner] if owner else replicated)

  opt_state = jax.tree_util.tree_map_with_path(like_its_parameter, jax.eval_shape(optimizer.init, params))
  return graphdef, TrainState(params, opt_state, jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated))


class CompiledStep(NamedTuple):
  """The train step compiled from shapes alone, before anything is allocated."""

  compiled: jax.stages.Compiled
  graphdef: nnx.GraphDef
  state: TrainState  # ShapeDtypeStructs with the shardings the real state gets
  mesh: jax.sharding.Mesh
  model_config: qwen3.Qwen3MoEConfig
  compile_s: float


def compile_step(run_config: RunConfig, devices=None) -> CompiledStep:
  """`devices` (default: all) may be compile-only devices of another machine's topology (`relaymoe-plan
  --topology`): nothing runs."""
  mesh = run_mesh(run_config, devices)
  model_config = model_config_for(run_config)
  optimizer, schedule = make_optimizer(run_config.optim, run_config.steps)
  graphdef, state = abstract_train_state(model_config, mesh, optimizer, run_config.seed)
  step_fn = jit_train_step(graphdef, optimizer, schedule, model_config, jax.tree.map(lambda x: x.sharding, state),
                           mesh)
  batch = jax.ShapeDtypeStruct((run_config.batch_size, run_config.seq_len + 1), jnp.int32,
                               sharding=NamedSharding(mesh, P(qwen3.TOKEN_AXES, None)))
  start = time.perf_counter()
  compiled = step_fn.lower(state, batch).compile()
  return CompiledStep(compiled, graphdef, state, mesh, model_config, time.perf_counter() - start)


def memory_plan(run_config: RunConfig, step: CompiledStep | None = None, devices=None):
  """Compiles the train step from shapes alone (no parameter is made) and returns its per-device memory in bytes:
  the training state (parameters and optimizer moments, exact), XLA's compiled temporaries and the total
  (arguments + outputs + temporaries − donated), with the device's allocator limit where it reports one (GPU) and
  the compile time. Whether a configuration fits, before it allocates anything (`relaymoe-train --compile-only`)."""
  step = step or compile_step(run_config, devices)
  limits = [(d.memory_stats() or {}).get("bytes_limit") for d in jax.local_devices()]
  return dict(
      devices=jax.device_count(), mesh=dict(step.mesh.shape), layers=step.model_config.num_hidden_layers,
      batch_size=run_config.batch_size, seq_len=run_config.seq_len, remat=step.model_config.remat,
      compile_s=step.compile_s,
      state_bytes=sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
                      for x in jax.tree.leaves(step.state)),
      temp_bytes=int(step.compiled.memory_analysis().temp_size_in_bytes),
      total_bytes=rm.compiled_bytes(step.compiled), device_limit_bytes=min(limits) if all(limits) else None)


class StepDoesNotFit(RuntimeError):
  """The compiled train step needs more memory per device than the device has."""


def check_fits(run_config: RunConfig, step: CompiledStep):
  """Raises StepDoesNotFit, with the numbers and the planner's suggestion, when the compiled step's bytes exceed
  the device's limit (`device_memory_gib`, else the allocator's; no limit known: no check)."""
  from train.plan import device_limit_bytes, suggest  # noqa: PLC0415  (train.plan builds on this module)
  limit = device_limit_bytes(run_config)
  plan = memory_plan(run_config, step)
  gib = lambda n: f"{n / 2**30:.2f} GiB"  # noqa: E731
  if limit is not None and plan["total_bytes"] > GROWING_ALLOCATOR_SAFE * limit and allocator_grows_on_demand():
    log_on_process_0(
        f"warning: the train step needs {gib(plan['total_bytes'])} of the {gib(limit)} allowed per device, and "
        "with XLA_PYTHON_CLIENT_PREALLOCATE=false the allocator grows region by region: the step's temporaries "
        f"({gib(plan['temp_bytes'])}, one block) may find no contiguous range and fail to allocate. Unset it to "
        "take the memory up front (docs/memory.md).")
  if limit is None or plan["total_bytes"] <= limit:
    return plan
  raise StepDoesNotFit(
      f"the train step needs {gib(plan['total_bytes'])} per device (training state {gib(plan['state_bytes'])}, "
      f"temporaries {gib(plan['temp_bytes'])}) and the device allows {gib(limit)}: batch_size="
      f"{run_config.batch_size} seq_len={run_config.seq_len} remat={_remat_name(step.model_config.remat)} "
      f"does not fit. {suggest(run_config)}")


# With the allocator growing on demand, the ring's 4-layer step at 96.6% of an H200's limit failed to allocate its
# temporaries (benchmarks/results/capacity_runs/5_*); steps under 90% have not been seen to.
GROWING_ALLOCATOR_SAFE = 0.9


def allocator_grows_on_demand():
  """JAX's GPU allocator without its memory taken up front (XLA_PYTHON_CLIENT_PREALLOCATE=false)."""
  grows = os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "").lower() in ("false", "0")
  return grows and jax.default_backend() == "gpu"


def log_on_process_0(message):
  if jax.process_index() == 0:
    print(message, flush=True)


def _remat_name(remat):
  return remat if isinstance(remat, str) else ",".join(remat)


def run(run_config: RunConfig, *, resume=False, overwrite=False):
  """Trains as configured; returns the logged metrics (a list of dicts).

  Holds the run directory for the run (`RunDirectory`: one run at a time; a fresh run refuses an earlier run's
  outputs unless `overwrite`). Raises FloatingPointError on a non-finite loss, keeping the last good checkpoint,
  and `Stopped` after saving a checkpoint on SIGTERM or SIGINT.
  """
  out = pathlib.Path(run_config.out_dir)
  with (RunDirectory(out, resume=resume, overwrite=overwrite), StopRequest() as stop,
        Checkpoints(out / "checkpoints", run_config.keep_checkpoints) as checkpoints):
    return _train(run_config, resume, checkpoints, stop)


def _train(run_config, resume, checkpoints, stop):
  from train.plan import resolve_remat  # noqa: PLC0415  (train.plan builds on this module)
  run_config, remat_plan, step = resolve_remat(run_config)
  model_config = model_config_for(run_config)
  source = make_source(run_config.data, model_config.vocab_size)
  if step is None:  # remat=auto compiled the chosen plan already
    log_on_process_0(f"compiling the train step ({model_config.num_hidden_layers} layers, {jax.device_count()} "
                     "devices)")
    step = compile_step(run_config)
  check_fits(run_config, step)  # before anything is allocated
  compiled, mesh, compile_s = step.compiled, step.mesh, step.compile_s
  if run_config.init_from and not resume:
    params = initial_params(run_config.init_from, model_overrides_for(run_config), model_config, mesh)
  else:  # a resumed run's parameters come from its checkpoint
    params = nnx.to_pure_dict(nnx.split(qwen3.create_sharded(model_config, mesh, seed=run_config.seed))[1])
  optimizer, schedule = make_optimizer(run_config.optim, run_config.steps)
  # Eager init: zeros_like keeps each parameter's sharding for its optimizer moments (a jitted init would not).
  state = on_mesh(TrainState(params, optimizer.init(params), jnp.zeros((), jnp.int32)), mesh)
  out = pathlib.Path(run_config.out_dir)
  start = 0
  if resume:
    state, meta = checkpoints.restore(state)
    start = int(meta["next_batch"])
  b, s = run_config.batch_size, run_config.seq_len
  flops_per_step = model_flops_per_token(model_config, s) * b * s
  peak_tflops = _peak_tflops(run_config)
  plan = dispatch_plan(model_config, run_config, mesh)
  if jax.process_index() == 0:
    (out / "run_config.json").write_text(json.dumps(dict(
        run=dataclasses.asdict(run_config), model=dataclasses.asdict(model_config),
        mesh=dict(mesh.shape), devices=jax.device_count(), backend=jax.default_backend(), compile_s=compile_s,
        entropy_floor=source.entropy_floor, dispatch_plan=plan and plan.as_dict(),
        remat_plan=remat_plan and remat_plan.as_dict()), indent=1, default=str))
    print(f"compiled in {compile_s:.1f} s", flush=True)
    if plan:
      print(f"MoE dispatcher {model_config.dispatcher}; ring volume model prefers {plan.reason}", flush=True)
  log = MetricsLog(out, run_config.steps, start, run_config.tensorboard)
  history = []
  pending = None  # (step, metrics of that step) still on device: read one step late
  window_start, window_steps = time.perf_counter(), 0

  def settle(step, metrics):
    nonlocal window_start, window_steps
    values = host_scalars(metrics)
    if not all(math.isfinite(values[k]) for k in ("loss", "grad_norm", "update_norm")):
      checkpoints.manager.wait_until_finished()
      latest = checkpoints.latest_step()
      raise FloatingPointError(
          f"non-finite training state at step {step}: loss {values['loss']}, gradient norm {values['grad_norm']}, "
          f"update norm {values['update_norm']}; stopping. " + (
              f"The last good checkpoint is step {latest} in {checkpoints.directory}" if latest is not None else
              f"There is no checkpoint yet in {checkpoints.directory}"))
    window_steps += 1
    if (step + 1) % run_config.log_every and step + 1 != run_config.steps:
      return
    elapsed = time.perf_counter() - window_start
    tflops = flops_per_step * window_steps / elapsed / jax.device_count() / 1e12
    record = dict(step=step, **values, tokens_per_s=b * s * window_steps / elapsed, tflops_per_device=tflops,
                  mfu=tflops / peak_tflops if peak_tflops else None, peak_memory_bytes=peak_memory_bytes(compiled))
    history.append(record)
    log.write(record)
    window_start, window_steps = time.perf_counter(), 0

  try:
    for step in range(start, run_config.steps):
      state, metrics = compiled(state, global_batch(source.batch(step, b, s), mesh))
      if pending:
        settle(*pending)
      pending = (step, metrics)
      log.advance()
      signum = stop.requested()
      every = run_config.checkpoint_every
      saving = signum or (every and ((step + 1) % every == 0 or step + 1 == run_config.steps))
      # A logged step is read as soon as it is done, so its window ends there: read one step late, it would end
      # when the next step's dispatch returns, which is late and varies (a step with data-dependent loops is
      # dispatched only as its loops finish on the device).
      if saving or (step + 1) % run_config.log_every == 0:
        settle(*pending)  # and never save a state whose loss was not finite
        pending = None
      if saving:
        checkpoints.save(step + 1, state, {"next_batch": step + 1, "samples_seen": (step + 1) * b})
      if signum:
        raise Stopped(signum, step + 1, checkpoints.directory)
    if pending:
      settle(*pending)
  finally:
    log.close()
  return history
