"""The training loop: the run directory held, the planned and compiled step, the model and optimizer state
(fresh, from `init_from`, or resumed), then steps with one-step-late metrics, checkpoints and a clean stop."""

import dataclasses
import json
import pathlib
import time

import jax
import jax.numpy as jnp
from flax import nnx

import relaymoe_jax as rm
from models import families
from relaymoe_jax.axes import EXPERT, TENSOR
from relaymoe_jax.ring.volume import EXPERT_MODE, TOKEN_MODE
from relaymoe_jax.errors import MissingInput
from train.rundir.checkpoints import Checkpoints
from train.config import RunConfig
from train.data.batches import DataChanged, batch, data_change, data_stamp, make_sources
from train.evaluate import Evaluator, check_held_out, eval_due, held_out_change
from train.mesh import global_batch, on_mesh, token_shards
from train.metrics import (LogWriteFailed, MetricsLog, host_scalars, log_on_process_0, peak_memory_bytes, peak_tflops,
                           size)
from train.rundir.preempt import FAILED, NAMES, StopRequest, Stopped
from train.profile.window import StepProfiler, check_window
from train.rundir.directory import RunDirectory
from train.run import resolve_documents, resolve_run, resolve_step
from train.sources import initial_params
from train.profile.step_parts import full_op_names
from train.step import BAD_IDS, TrainState, make_optimizer, model_flops_per_token, non_finite_state


def dispatch_plan(model_config, run_config, mesh):
  """Both ring modes' per-hop bytes for this run's MoE layers, and which one `auto` runs (logged at start); None
  without MoE layers or for a ring of one, where nothing moves."""
  if mesh.shape[EXPERT] == 1 or not any(model_config.is_sparse(i) for i in range(model_config.num_hidden_layers)):
    return None
  return rm.plan_dispatch(
      tokens_per_device=run_config.micro_batch_size * run_config.seq_len // token_shards(mesh),
      d_model=model_config.hidden_size, d_ff=model_config.moe_intermediate_size,
      num_experts=model_config.num_experts, top_k=model_config.num_experts_per_tok, ring_size=mesh.shape[EXPERT],
      dtype=run_config.runtime.dtype,
      expert_tensor_parallel=mesh.shape[TENSOR] if run_config.runtime.moe_tensor_parallel else 1)


def run(run_config: RunConfig, *, resume=False, overwrite=False, profile=None):
  """Trains as configured; returns the logged metrics (a list of dicts).

  Holds the run directory for the run (`RunDirectory`: one run at a time; a fresh run refuses an earlier run's
  outputs unless `overwrite`). Raises FloatingPointError on a non-finite loss, keeping the last good checkpoint,
  `Stopped` after saving a checkpoint on SIGTERM or SIGINT, LogWriteFailed (after saving a checkpoint) when
  metrics.jsonl does not write, and CheckpointSaveFailed when the disk is full. A signal that arrives while the
  last step's checkpoint is saved lets the save finish: the run is complete. `profile`: a `train.profile.window.Window`
  of steps to trace (the step compiled with `full_op_names`), whose part table is printed when it ends.
  """
  out = pathlib.Path(run_config.out_dir)
  with RunDirectory(out, resume=resume, overwrite=overwrite), StopRequest() as stop, full_op_names(bool(profile)):
    with Checkpoints(out / "checkpoints", run_config.keep_checkpoints) as checkpoints:
      history, last_eval = _train(run_config, resume, checkpoints, stop, profile)
      stop.note = "letting the last checkpoint's save finish (the run is complete)"
    if stop.signum:
      saved = checkpoints.last_saved
      log_on_process_0(f"got {NAMES[stop.signum]} after the last step: the run is complete" + (
          f", its last checkpoint (step {saved}) saved" if saved is not None else ""))
  if history:
    log_on_process_0(_closing_line(history[-1], last_eval, out))
  return history


def _closing_line(last, last_eval, out):
  """What the run ended at, in the numbers of its saved checkpoint's name (steps done)."""
  held_out = f"; held-out loss {last_eval['eval_loss']:.4f}" if last_eval else ""
  return (f"done: {last['step'] + 1} steps, loss {last['loss']:.4f} ({last['tokens_per_s']:.0f} tokens/s)"
          f"{held_out}; metrics in {out / 'metrics.jsonl'}")


def dispatcher_line(dispatcher, plan):
  """The MoE dispatcher the run uses and, for a ring, what each ring would send per hop: a person can then choose
  the other with `runtime.dispatcher=` (`auto` takes the one that sends less)."""
  if plan is None or dispatcher not in (EXPERT_MODE, TOKEN_MODE, "auto"):
    return f"MoE dispatcher: {dispatcher}"
  mib = {mode: f"{volume.bytes_per_hop / 2**20:.2f} MiB"
         for mode, volume in ((EXPERT_MODE, plan.expert_routing), (TOKEN_MODE, plan.token_routing))}
  other = TOKEN_MODE if plan.mode == EXPERT_MODE else EXPERT_MODE
  if dispatcher == "auto":
    return (f"MoE dispatcher: auto runs {plan.mode}, which sends {mib[plan.mode]} per hop (forward + backward) "
            f"against {mib[other]} for {other}")
  line = f"MoE dispatcher: {dispatcher}, sending {mib[dispatcher]} per hop (forward + backward)"
  if dispatcher != plan.mode:
    line += f"; {plan.mode} would send {mib[plan.mode]} (runtime.dispatcher={plan.mode} or auto)"
  return line


def _last_good(checkpoints):
  """Where the run can continue from, once the saves in flight are done."""
  checkpoints.finish()
  latest = checkpoints.latest_step()
  return (f"The last good checkpoint is step {latest} in {checkpoints.directory}" if latest is not None else
          f"There is no checkpoint yet in {checkpoints.directory}")


def _say_if_data_changed(run_config_path, stamp, eval_config):
  """A resume says so when the data file is not the one the run's checkpoints were trained on (size, time), and when
  it holds out data they were trained on (a larger `eval.fraction`)."""
  try:
    stored = json.loads(run_config_path.read_text())
    before, eval_before = stored.get("data_file"), stored.get("run", {}).get("eval")
  except (OSError, ValueError, AttributeError):
    return
  for change in (data_change(before, stamp), held_out_change(eval_before, eval_config)):
    if change:
      print(change, flush=True)


def _say_how_documents_are_read(data, source):
  """One line where the data has documents: whether they are masked, and the id that ends each."""
  if not data.has_documents():
    return
  how = "masked: none attends to another" if data.masks_documents() else "not masked (data.document_masking=false)"
  log_on_process_0(f"documents: {how}; each ends at token id {source.eos}")


def _train(run_config, resume, checkpoints, stop, profile):
  if resume and checkpoints.latest_step() is None:  # before anything compiles
    raise MissingInput(f"--resume: no checkpoint in {checkpoints.directory}")
  if profile:
    check_window(profile, checkpoints.latest_step() if resume else 0, run_config.steps,
                 pathlib.Path(run_config.out_dir) / "profile")
  resolved = resolve_run(run_config)  # the model config and mesh, once
  model_config = resolved.model_config
  source, held_out = make_sources(run_config.data, run_config.eval, model_config.vocab_size, run_config.seq_len)
  if held_out:
    check_held_out(run_config, held_out)
  resolved = resolve_documents(resolved, source)
  stamp = data_stamp(run_config.data)
  with stop.at_once():  # a signal while the step is planned and compiled (minutes) stops the run there
    resolved = resolve_step(resolved, resume)
    memory = resolved.check_fits()  # before anything is allocated
  run_config, remat_plan, step, mesh = resolved.run_config, resolved.remat_plan, resolved.step, resolved.mesh
  compiled, compile_s = step.compiled, step.compile_s
  runtime = run_config.runtime
  _say_how_documents_are_read(run_config.data, source)
  if run_config.init_from and not resume:
    params, origin = initial_params(run_config.init_from, model_config, runtime, mesh)
    log_on_process_0(f"init_from: starting from the parameters of {origin} (the optimizer starts afresh)")
  else:  # a resumed run's parameters come from its checkpoint
    params = nnx.to_pure_dict(nnx.split(families.create_sharded(model_config, mesh, seed=run_config.seed,
                                                                runtime=runtime))[1])
  optimizer, schedule = make_optimizer(run_config.optim, run_config.steps)
  # Eager init: zeros_like keeps each parameter's sharding for its optimizer moments (a jitted init would not).
  state = on_mesh(TrainState(params, optimizer.init(params), jnp.zeros((), jnp.int32)), mesh)
  out = pathlib.Path(run_config.out_dir)
  start = 0
  if resume:
    state, meta = checkpoints.restore(state)
    start = int(meta["next_batch"])
    log_on_process_0(f"resuming from step {start} (checkpoint {checkpoints.directory / str(start)})")
  b, s = run_config.batch_size, run_config.seq_len
  flops_per_step = model_flops_per_token(model_config, s) * b * s
  peak = peak_tflops(run_config)
  plan = dispatch_plan(model_config, run_config, mesh)
  if jax.process_index() == 0:
    if resume:
      _say_if_data_changed(out / "run_config.json", stamp, run_config.eval)
    (out / "run_config.json").write_text(json.dumps(dict(
        run=dataclasses.asdict(run_config), model=dataclasses.asdict(model_config),
        mesh=dict(mesh.shape), devices=jax.device_count(), backend=jax.default_backend(), compile_s=compile_s,
        entropy_floor=source.entropy_floor, dispatch_plan=plan and plan.as_dict(),
        remat_plan=remat_plan and remat_plan.as_dict(), data_file=stamp), indent=1, default=str))
    print(f"compiled in {compile_s:.1f} s: {size(memory['total_bytes'])} per device", flush=True)
    print(dispatcher_line(runtime.dispatcher, plan), flush=True)
  moe_layers = [i for i in range(model_config.num_hidden_layers) if model_config.is_sparse(i)]
  log = MetricsLog(out, run_config.steps, start, run_config.tensorboard, moe_layers)
  evaluator = held_out and Evaluator(run_config, held_out, step.graphdef, state.params, mesh, stop.requested)
  if evaluator:
    log_on_process_0(f"held-out loss: forward compiled for {run_config.micro_batch_size} rows at a time, "
                     f"{size(rm.compiled_bytes(evaluator.compiled))} per device")
  profiler = profile and StepProfiler(profile, out / "profile", compiled, b * s, flops_per_step, peak)
  history, last_eval = [], None
  pending = None  # (step, metrics of that step) still on device: read one step late
  window_start, window_steps = time.perf_counter(), 0

  def settle(step, metrics):
    nonlocal window_start, window_steps
    values = host_scalars(metrics)
    bad_ids = int(values.pop(BAD_IDS))
    if bad_ids:
      raise DataChanged(f"step {step}: {bad_ids} token ids of its batch are outside the vocabulary "
                        f"(vocab_size={model_config.vocab_size}): data.path {run_config.data.path!r} changed under "
                        f"the run; stopping. {_last_good(checkpoints)}")
    if bad := non_finite_state(values):
      raise FloatingPointError(f"non-finite training state at step {step}: {bad}; stopping. {_last_good(checkpoints)}")
    window_steps += 1
    if (step + 1) % run_config.log_every and step + 1 != run_config.steps:
      return
    elapsed = time.perf_counter() - window_start
    tflops = flops_per_step * window_steps / elapsed / jax.device_count() / 1e12
    record = dict(step=step, **values, tokens_per_s=b * s * window_steps / elapsed, tflops_per_device=tflops,
                  mfu=tflops / peak if peak else None, peak_memory_bytes=peak_memory_bytes(compiled))
    history.append(record)
    log.write(record)
    window_start, window_steps = time.perf_counter(), 0

  try:
    for step in range(start, run_config.steps):
      if profiler:  # its own work is no step's time
        window_start += profiler.before_step(step, state)
      state, metrics = compiled(state, global_batch(batch(source, step, b, s, run_config.data.masks_documents()),
                                                    mesh, run_config.runtime))
      if profiler:
        window_start += profiler.after_step(step, state)
      checkpoints.poll()
      if pending:
        settle(*pending)
      pending = (step, metrics)
      log.advance()
      stop.failed = stop.failed or log.failure is not None  # all processes stop with process 0, which logs
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
      if evaluator and eval_due(run_config, step) and (values := evaluator(state.params)):  # None: a signal came
        last_eval = values
        window_start += values["eval_s"]  # neither the throughput nor the step time counts it
        if profiler:
          profiler.exclude(values["eval_s"])
        log.write(dict(step=step, **values))
      if signum == FAILED:
        checkpoints.finish()
        raise LogWriteFailed(f"{log.failure or 'process 0 could not write metrics.jsonl'}; stopped after step "
                             f"{step}, saved checkpoint step {step + 1} in {checkpoints.directory}; continue with "
                             "--resume")
      if signum:
        raise Stopped(signum, step + 1, checkpoints.directory)
    if pending:
      settle(*pending)
    if log.failure:  # at the last step: its checkpoint, if any, is saved
      raise LogWriteFailed(f"{log.failure}; the run finished; its last checkpoint is in {checkpoints.directory}")
  finally:
    log.close()
  return history, last_eval
