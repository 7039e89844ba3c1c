"""`runtime.remat: auto` for the trainer: the plan recorded for this configuration (in the run directory, or this
machine's plan cache beside the compilation cache), else a new plan, recorded; and the fit guard's suggestion."""

import pathlib

import jax

from models.qwen3_config import REMAT_AUTO
from train.compile import StepDoesNotFit
from train.metrics import log_on_process_0, size
from train.plan import apply_plan, make_planner
from train.plan_record import PLAN_FILE, cached_plan_path, plan_key, store_plan, stored_plan
from train.sources import model_config_for


def resolve_remat(run_config):
  """(the run with `remat: auto` replaced by the planned per-layer policies, the Plan, that plan's CompiledStep or
  None where the plan was the run directory's); other runs unchanged, with None for both."""
  if run_config.runtime.remat != REMAT_AUTO:
    return run_config, None, None
  planner = make_planner(run_config, log=log_on_process_0, keep_steps=True)
  path = pathlib.Path(run_config.out_dir) / PLAN_FILE
  key = plan_key(run_config, model_config_for(run_config), planner.budget_bytes)
  cached = cached_plan_path(run_config, key)
  for where in filter(None, (path, cached)):
    plan = stored_plan(where, key)
    if plan:
      log_on_process_0(f"remat auto: {plan.summary()} ({size(plan.total_bytes)} per device of "
                       f"{size(plan.budget_bytes)}), planned before for this configuration ({where})")
      _record(plan, key, path, cached)
      return apply_plan(run_config, plan), plan, None
  plan = planner.plan()
  if not plan.fits:
    raise StepDoesNotFit(f"runtime.remat=auto: even {plan.remat[0]} in every layer needs "
                         f"{size(plan.total_bytes)} per device, over the budget of "
                         f"{size(plan.budget_bytes)}. {_search_hint()}")
  log_on_process_0(f"remat auto: {plan.summary()} ({size(plan.total_bytes)} per device of "
                   f"{size(plan.budget_bytes)})")
  _record(plan, key, path, cached)
  return apply_plan(run_config, plan), plan, planner.compiled_step(plan.remat, plan.keep_gate_up)


def _record(plan, key, path, cached=None):
  """Keeps the plan in the run directory and, where given, this machine's plan cache: a cache that cannot be
  written costs a warning, not the run."""
  if jax.process_index() != 0:
    return
  store_plan(path, key, plan)
  if cached is None:
    return
  try:
    store_plan(cached, key, plan)
  except OSError as e:
    log_on_process_0(f"warning: the plan was not cached for other run directories ({cached}: {e.strerror or e})")


def _quiet(*_):
  pass


def suggest(run_config):
  """What the planner would change so that the run fits, in one sentence (it compiles a few variants)."""
  plan = make_planner(run_config, log=_quiet).plan()
  if plan.fits:
    return (f"With runtime.remat=auto it fits: {plan.summary()}, {size(plan.total_bytes)} per device "
            f"(`relaymoe-plan` prints the plan).")
  return (f"Even {plan.remat[0]} in every layer needs {size(plan.total_bytes)} per device. "
          f"{_search_hint()}")


def _search_hint():
  return ("`relaymoe-plan --config RUN --maximize seq` (or batch) finds the longest sequence (largest micro-batch) "
          "that fits.")
