"""The held-out loss: the mean next-token cross-entropy over the same `eval.batches` held-out batches each time
(`train.data.batches.make_sources`), over the targets in their input's document where documents are masked, and its
perplexity. Forward only (the chunked per-token loss head), compiled once, on the training mesh; `relaymoe-train
--eval-only` evaluates `init_from`'s weights without training."""

import dataclasses
import json
import math
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import families
from relaymoe_jax.errors import UserError
from train.data.batches import TokenWindows, batch, make_sources, next_token_inputs
from train.mesh import check_batch_split, global_batch
from train.run import resolve_documents
from train.metrics import log_on_process_0
from train.sources import initial_params


def _sums(graphdef, params, batch):
  """(Σ weight · cross-entropy, Σ weight) of one batch, float32 scalars."""
  model = nnx.merge(graphdef, nnx.State(params))
  inputs_BS, labels_BS, documents = next_token_inputs(batch)
  weights_BS = documents.pop("weights_BS", None)
  ce_BS, _ = model.cross_entropy_and_aux(inputs_BS, labels_BS, **documents)
  weights_BS = jnp.ones_like(ce_BS) if weights_BS is None else weights_BS.astype(jnp.float32)
  return jnp.sum(ce_BS * weights_BS), jnp.sum(weights_BS)


class Evaluator:
  """`evaluator(params)` → {eval_loss, eval_ppl, eval_tokens, eval_s}, or None where `interrupted()` (the loop's
  `StopRequest.requested`) turned true between batches. The forward is compiled once, at construction, for the
  step's micro-batch (`micro_batches` pieces of each held-out batch, so an eval needs no more memory than the step);
  the batches are read from their source at each evaluation (all held from the start, a large `eval.batches` filled
  memory before the first step)."""

  def __init__(self, run_config, source, graphdef, params, mesh, interrupted=lambda: None):
    self.run_config, self.source, self.mesh, self.interrupted = run_config, source, mesh, interrupted
    source.batch_name = "held-out batch"
    self.compiled = jax.jit(lambda p, x: _sums(graphdef, p, x)).lower(params, next(self._pieces(0))).compile()

  def _pieces(self, i):
    """Held-out batch `i` as the step's micro-batches, each placed on the mesh."""
    c = self.run_config
    host = batch(self.source, i, c.batch_size, c.seq_len, c.data.masks_documents())
    rows = c.micro_batch_size
    for start in range(0, c.batch_size, rows):
      yield global_batch({k: v[start:start + rows] for k, v in host.items()}, self.mesh, c.runtime)

  def __call__(self, params):
    jax.block_until_ready(params)  # the training step before is not the evaluation's time
    start = time.perf_counter()
    sums = []
    for i in range(self.run_config.eval.batches):
      if self.interrupted():
        return None
      sums += [self.compiled(params, x) for x in self._pieces(i)]
    loss_sum, tokens = (sum(float(np.asarray(v.addressable_data(0))) for v in column) for column in zip(*sums))
    loss = loss_sum / max(tokens, 1.0)
    return dict(eval_loss=loss, eval_ppl=math.exp(min(loss, 700.0)), eval_tokens=int(tokens),
                eval_s=time.perf_counter() - start)


def eval_due(run_config, step):
  """Whether the held-out loss is taken after `step`: every `eval.every` steps, and after the last."""
  every = run_config.eval.every
  return bool(every and (step + 1) % every == 0) or step + 1 == run_config.steps


def held_out_change(before, now):
  """A warning where a resumed run's `eval.fraction` (`now`) holds out data that the steps before it trained on
  (`before`: the run's stored `eval`, a dict); else None."""
  fraction = (before or {}).get("fraction") or 0.0
  if not isinstance(fraction, (int, float)) or now.fraction <= fraction:
    return None
  return (f"warning: eval.fraction={now.fraction} holds out data that the steps before this resume trained on (they "
          f"ran with eval.fraction={fraction}): the held-out loss is partly over data the model has seen, and the "
          "training batches from here on are cut from less data")


def check_held_out(run_config, source):
  """Held-out data that gives `eval.batches` distinct batches with targets to count, else a UserError: a short file
  was read round again, and one with no counted target reported a loss of 0."""
  b, s, n = run_config.batch_size, run_config.seq_len, run_config.eval.batches
  if isinstance(source, TokenWindows):
    windows = (source.num_tokens - 1) // s
    if n * b > windows:
      fits = (f"at most eval.batches={windows // b}" if windows >= b else
              f"not one batch of batch_size={b}: give more held-out data")
      raise UserError(f"eval.batches={n} × batch_size={b} needs {n * b} windows of seq_len+1={s + 1} tokens, and "
                      f"{source.where} holds {windows} ({source.num_tokens} tokens): {fits}")
  if not run_config.data.masks_documents() or source.eos is None:
    return
  counted = sum(int(next_token_inputs(batch(source, i, b, s, True))[2]["weights_BS"].sum()) for i in range(n))
  if not counted:
    raise UserError(f"{source.where}: no target of the {n} held-out batches is in its input's document (every "
                    f"input is the EOS id {source.eos}, data.eos_token), so there is no held-out loss to take")


def evaluate_only(run):
  """`relaymoe-train --eval-only`: the held-out loss of `init_from`'s weights, printed and written to
  OUT/eval.json; returns its dict. `run`: the run resolved (`train.run.resolve_run`: its model config and mesh)."""
  run_config, model_config, mesh = run.run_config, run.model_config, run.mesh
  if not run_config.init_from:
    raise UserError("--eval-only evaluates the weights of init_from=hf:DIR or init_from=orbax:DIR (a relaymoe-convert "
                    "output or a relaymoe-train run directory); none given")
  _, source = make_sources(run_config.data, run_config.eval, model_config.vocab_size, run_config.seq_len,
                           held_out=True)
  run_config = resolve_documents(run, source).run_config
  run_config = dataclasses.replace(run_config, runtime=dataclasses.replace(run_config.runtime, remat="none"))
  check_held_out(run_config, source)
  check_batch_split(run_config, mesh)
  params, origin = initial_params(run_config.init_from, model_config, run_config.runtime, mesh)
  graphdef = families.abstract(model_config, mesh, runtime=run_config.runtime)[0]
  values = Evaluator(run_config, source, graphdef, params, mesh)(params)
  if jax.process_index() == 0:
    out = pathlib.Path(run_config.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "eval.json").write_text(json.dumps(dict(init_from=run_config.init_from, **values)))
  log_on_process_0(f"eval of {origin}: loss {values['eval_loss']:.4f} perplexity {values['eval_ppl']:.2f} over "
                   f"{values['eval_tokens']} tokens of {run_config.eval.batches} batches "
                   f"({values['eval_s']:.1f} s)")
  return values
