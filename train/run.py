"""The run resolved once: its model config (the run's `model`, or `init_from`'s), its mesh and, for the trainer, its
runtime with `remat: auto` and `loss_chunk_tokens: auto` replaced by their choices, the remat plan and the compiled
step. `relaymoe-train` (training, `--compile-only`, `--eval-only`) and `relaymoe-plan` make one at the start; the
trainer's parts take it, or the piece they need, instead of deriving their own from the run config."""

import dataclasses
import functools

import jax

from models.attention.cudnn_documents import heads_split, packed_bound
from models.runtime import DOCUMENTS_AUTO
from relaymoe_jax.axes import TENSOR
from train.compile import CompiledStep, check_fits, compile_step
from train.config import RunConfig
from train.mesh import build_mesh, check_batch_split
from train.metrics import log_on_process_0
from train.plan.loss_chunk import resolve_loss_chunk
from train.plan.record import Plan
from train.plan.remat_auto import resolve_remat, suggest
from train.sources import model_config_for


@dataclasses.dataclass(frozen=True)
class Run:
  """What a run config resolves to. `run_config`'s runtime is resolved once `resolve_step` has run (before: as
  configured); the planner's variations of it (shapes, remat, ring options) never change the model or the mesh."""

  run_config: RunConfig
  model_config: object  # the family's architecture config (`models.families`)
  mesh: jax.sharding.Mesh  # built from `run_config.mesh`; each compile checks it splits that step's batch
  remat_plan: Plan | None = None  # `remat: auto`'s plan (by `resolve_step`)
  step: CompiledStep | None = None  # the train step to run (by `resolve_step`)

  def compile(self, memory_only=False) -> CompiledStep:
    """The train step of `run_config` as it stands, compiled from shapes alone."""
    return compile_step(self.run_config, memory_only=memory_only, model_config=self.model_config, mesh=self.mesh)

  def check_fits(self):
    """The compiled step's memory plan; raises `StepDoesNotFit` (with the planner's suggestion) where it does not
    fit the device."""
    return check_fits(self.run_config, self.step, functools.partial(suggest, model_config=self.model_config,
                                                                    mesh=self.mesh))


def resolve_run(run_config: RunConfig, devices=None) -> Run:
  """The run's model config (read once: the `init_from` source's may be a file) and mesh over `devices` (default:
  all; compile-only devices for `relaymoe-plan --topology`)."""
  return Run(run_config, model_config_for(run_config), build_mesh(run_config.mesh, devices))


def resolve_documents(run: Run, source) -> Run:
  """`run` with `runtime.documents_per_row: auto` replaced by M for its data: the most documents the inputs of one
  of the windows the run reads from `source` hold (`most_documents`), within what one row's packed backward may take
  (`packed_bound`; a call with a fuller row takes the tile loop, exact either way); as it was where documents are
  not masked."""
  run_config, c = run.run_config, run.model_config
  if run_config.runtime.documents_per_row != DOCUMENTS_AUTO or not run_config.data.masks_documents():
    return run
  most = source.most_documents(run_config.seq_len, run_config.steps * run_config.batch_size)
  if most is None:
    return run
  tensor = run.mesh.shape.get(TENSOR, 1)
  heads = c.num_attention_heads // tensor if heads_split(c.num_key_value_heads, tensor) else c.num_attention_heads
  m = packed_bound(most, run_config.seq_len, heads, c.head_dim)
  over = "; a call holding a fuller row takes the tile loop" if m < most else ""
  log_on_process_0(f"documents: at most {most} in a row of {source.where}: cuDNN's packed layout holds {m} a row "
                   f"(runtime.documents_per_row=auto){over}")
  runtime = dataclasses.replace(run_config.runtime, documents_per_row=m)
  return dataclasses.replace(run, run_config=dataclasses.replace(run_config, runtime=runtime))


def resolve_step(run: Run, resume=False) -> Run:
  """`run` with its runtime resolved (`remat: auto`'s plan, `loss_chunk_tokens: auto`'s chunk: `train.plan`) and its
  train step compiled. `resume`: keep the plan the run's checkpoints were written with."""
  check_batch_split(run.run_config, run.mesh)  # before the planner compiles anything
  run_config, remat_plan, step = resolve_remat(run.run_config, run.model_config, run.mesh, resume)
  run_config, step = resolve_loss_chunk(run_config, step, model_config=run.model_config, mesh=run.mesh)
  run = dataclasses.replace(run, run_config=run_config, remat_plan=remat_plan, step=step)
  if step is None:  # neither remat=auto nor the loss chunk's search compiled the step to run
    log_on_process_0(f"compiling the train step ({run.model_config.num_hidden_layers} layers, {jax.device_count()} "
                     "devices)")
    run = dataclasses.replace(run, step=run.compile())
  return run
