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
from train.data.batches import batch, make_sources, next_token_inputs
from train.mesh import check_batch_split, global_batch
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
  """`evaluator(params)` → {eval_loss, eval_ppl, eval_tokens, eval_s}: the held-out batches are placed on the mesh
  once and the forward compiled once, at construction."""

  def __init__(self, run_config, source, graphdef, params, mesh):
    b, s = run_config.batch_size, run_config.seq_len
    masks = run_config.data.masks_documents()
    self.batches = [global_batch(batch(source, i, b, s, masks), mesh, run_config.runtime)
                    for i in range(run_config.eval.batches)]
    self.compiled = jax.jit(lambda p, x: _sums(graphdef, p, x)).lower(params, self.batches[0]).compile()

  def __call__(self, params):
    jax.block_until_ready(params)  # the training step before is not the evaluation's time
    start = time.perf_counter()
    sums = [self.compiled(params, x) for x in self.batches]
    loss_sum, tokens = (sum(float(np.asarray(v.addressable_data(0))) for v in column) for column in zip(*sums))
    loss = loss_sum / max(tokens, 1.0)
    return dict(eval_loss=loss, eval_ppl=math.exp(min(loss, 700.0)), eval_tokens=int(tokens),
                eval_s=time.perf_counter() - start)


def evaluate_only(run):
  """`relaymoe-train --eval-only`: the held-out loss of `init_from`'s weights, printed and written to
  OUT/eval.json; returns its dict. `run`: the run resolved (`train.run.resolve_run`: its model config and mesh)."""
  run_config, model_config, mesh = run.run_config, run.model_config, run.mesh
  if not run_config.init_from:
    raise UserError("--eval-only evaluates the weights of init_from=hf:DIR or init_from=orbax:DIR (a relaymoe-convert "
                    "output or a relaymoe-train run directory); none given")
  run_config = dataclasses.replace(run_config, runtime=dataclasses.replace(run_config.runtime, remat="none"))
  _, source = make_sources(run_config.data, run_config.eval, model_config.vocab_size, run_config.seq_len,
                           held_out=True)
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
