"""`runtime.remat: auto` for the trainer: the plan recorded for this configuration (in the run directory, or this
machine's plan cache beside the compilation cache), else a new plan, recorded; and the fit guard's suggestion."""

import json
import pathlib

import jax

from models.runtime import LOSS_CHUNK_AUTO, REMAT_AUTO
from relaymoe_jax.errors import UserError
from train.compile import StepDoesNotFit
from train.plan.loss_chunk import ChunkSteps, resolve_loss_chunk, searches, with_loss_chunk
from train.metrics import log_on_process_0, size
from train.plan.planner import apply_plan, make_planner
from train.plan.record import PLAN_FILE, cached_plan_path, plan_from_dict, plan_key, store_plan, stored_plan


def resolve_remat(run_config, model_config, mesh, resume=False):
  """(the run with `remat: auto` replaced by the planned per-layer policies, the Plan, that plan's CompiledStep or
  None where the plan was a stored one); other runs unchanged, with None for both. `model_config`, `mesh`: the
  run's, resolved once (`train.run.Run`). A new plan also records
  `loss_chunk_tokens: auto`'s choice, searched with the plan's step, so that a rerun searches neither.

  A `resume` keeps the plan the run's checkpoints were written with, whatever would be planned now (with
  `scan_layers` the plan decides how layers stack, so another could not restore them), and records nothing in the
  run directory: its `run_config.json`, written once the checkpoint has restored, records the plan."""
  if run_config.runtime.remat != REMAT_AUTO:
    return run_config, None, None
  layers, out = model_config.num_hidden_layers, pathlib.Path(run_config.out_dir)
  own = _checkpoints_plan(out, layers) if resume else None
  if own:
    plan, where = own
    log_on_process_0(f"remat auto: {plan.summary()}, the plan this run's checkpoints were written with ({where})")
    return _applied(run_config, plan), plan, None
  # Where the loss chunk is still to be searched, the plan's step is not the one to run: compiled for memory only, at
  # once with the search's first round.
  chunk_steps = ChunkSteps(model_config=model_config, mesh=mesh)
  planner = make_planner(run_config, model_config, mesh, log=log_on_process_0, keep_steps=True,
                         candidates_to_run=not searches(run_config, mesh=mesh), alongside=chunk_steps.ahead)
  path = None if resume else out / PLAN_FILE
  key = plan_key(run_config, model_config, planner.budget_bytes)
  cached = cached_plan_path(run_config, key)
  for where in filter(None, (path, cached)):
    plan = stored_plan(where, key, layers, log_on_process_0)
    if plan:
      log_on_process_0(f"remat auto: {plan.summary()} ({size(plan.total_bytes)} per device of "
                       f"{size(plan.budget_bytes)}), planned before for this configuration ({where})")
      _record(plan, key, path, None if where == cached else cached)  # a read-only cache that holds it is fine
      return _applied(run_config, plan), plan, None
  plan = planner.plan()
  if not plan.fits:
    raise StepDoesNotFit(f"runtime.remat=auto: even {plan.remat[0]} in every layer needs "
                         f"{size(plan.total_bytes)} per device, over the budget of "
                         f"{size(plan.budget_bytes)}. {_search_hint()}")
  log_on_process_0(f"remat auto: {plan.summary()} ({size(plan.total_bytes)} per device of "
                   f"{size(plan.budget_bytes)})")
  chosen, step = resolve_loss_chunk(apply_plan(run_config, plan), planner.compiled_step(plan.remat, plan.keep_gate_up),
                                    base_bytes=plan.total_bytes, model_config=model_config, mesh=mesh,
                                    compiles=chunk_steps)
  if run_config.runtime.loss_chunk_tokens == LOSS_CHUNK_AUTO:  # a chunk the user set is no choice of the plan's
    plan.loss_chunk_tokens = chosen.runtime.loss_chunk_tokens
  run_config = chosen
  _record(plan, key, path, cached)
  return run_config, plan, step


def _applied(run_config, plan):
  """The run as a stored plan says, with the loss chunk it chose where the run leaves that to `auto`."""
  run_config = apply_plan(run_config, plan)
  if plan.loss_chunk_tokens is not None and run_config.runtime.loss_chunk_tokens == LOSS_CHUNK_AUTO:
    log_on_process_0(f"loss chunk auto: {plan.loss_chunk_tokens} tokens per device, chosen with the plan")
    return with_loss_chunk(run_config, plan.loss_chunk_tokens)
  return run_config


def _checkpoints_plan(out, layers):
  """(the plan the checkpoints in `out` were written with, where it was read) or None: the one in `out`'s
  run_config.json (written once a run's checkpoint restored), else `out`'s plan record of any configuration."""
  run_config = out / "run_config.json"
  try:
    recorded = json.loads(run_config.read_text()).get("remat_plan")
  except FileNotFoundError:
    recorded = None
  except (OSError, ValueError, AttributeError) as err:
    log_on_process_0(f"warning: ignored the remat plan in {run_config}: {getattr(err, 'strerror', None) or err}")
    recorded = None
  if recorded is not None:
    try:
      return plan_from_dict(recorded, layers), run_config
    except ValueError as err:
      log_on_process_0(f"warning: ignored the remat plan in {run_config}: {err}")
  plan = stored_plan(out / PLAN_FILE, None, layers, log_on_process_0)
  return plan and (plan, out / PLAN_FILE)


def _record(plan, key, path, cached):
  """Keeps the plan in the run directory (where given) and this machine's plan cache (where given): a cache that
  cannot be written costs a warning, not the run."""
  if jax.process_index() != 0:
    return
  if path is not None:
    try:
      store_plan(path, key, plan)
    except OSError as e:
      raise UserError(f"cannot record the remat plan in {path} ({e.strerror or e})") from None
  if cached is None:
    return
  try:
    store_plan(cached, key, plan)
  except OSError as e:
    log_on_process_0(f"warning: the plan was not cached for other run directories ({cached}: {e.strerror or e})")


def _quiet(*_):
  pass


def suggest(run_config, model_config, mesh):
  """What the planner would change so that the run (of `model_config` on `mesh`) fits, in one sentence (it compiles
  a few variants)."""
  plan = make_planner(run_config, model_config, mesh, log=_quiet).plan()
  if plan.fits:
    return (f"With runtime.remat=auto it fits: {plan.summary()}, {size(plan.total_bytes)} per device "
            f"(`relaymoe-plan` prints the plan).")
  return (f"Even {plan.remat[0]} in every layer needs {size(plan.total_bytes)} per device. "
          f"{_search_hint()}")


def _search_hint():
  return ("`relaymoe-plan --config RUN --maximize seq` (or batch) finds the longest sequence (largest micro-batch) "
          "that fits.")
