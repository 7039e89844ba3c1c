"""`runtime.loss_chunk_tokens: auto` for the trainer: the largest loss-head chunk whose compiled step needs no more
memory per device than the step at the default chunk, so that the remat plan and its peak stay as they are.

The loss head's chunk (`models.loss.mean_cross_entropy`) holds [chunk, V] float32 logits and their bf16 gradient;
larger chunks launch fewer, larger matmuls and re-read the float32 head-gradient accumulator less often. Whether a
chunk's buffers raise the step's peak depends on what else is live at the end of the forward (the layers'
residuals, the first backward layer's temporaries), which only XLA's buffer assignment knows: so each candidate,
the default doubled up to the tokens per device (and LARGEST_TOKENS), is compiled from shapes alone for its memory
(on GPUs without the autotuner, `train.compile.MEMORY_ONLY_OPTIONS`), several at once where the host has the cores,
in a search over them (the bytes grow with the chunk). The largest still in question is compiled to run: where it
fits, the search ends with it and the trainer runs that step, one compile fewer before the first step. With
`remat: auto` the first round compiles at once with the plan's own compile (`ChunkSteps`).
"""

import dataclasses
import functools

from models.runtime import DEFAULT_LOSS_CHUNK_TOKENS, LOSS_CHUNK_AUTO
from train.compile import at_once, compile_step, concurrent_compiles, memory_only_options, memory_plan
from train.mesh import build_mesh, token_shards
from train.metrics import log_on_process_0, size

# A step compiled with the autotuner and one compiled without differ by a few KB (train.compile); more is a change.
SAME_BYTES = 1 << 20
# Past this the head gains nothing: on one H200 at 65536 tokens (D 2048, vocabulary 151936) it took 225.0, 213.1,
# 209.8 and 210.9 ms at chunks of 1024, 4096, 8192 and 16384 (`benchmarks/results/loss_head.txt`): doubling past 8192
# halves only the float32 head-gradient accumulator's re-reads, once a chunk (about 2 ms there). Fewer candidates
# (three at most): one round of compiles where the host has the cores.
LARGEST_TOKENS = 8192


def with_loss_chunk(run_config, chunk_tokens):
  return dataclasses.replace(run_config, runtime=dataclasses.replace(run_config.runtime,
                                                                     loss_chunk_tokens=chunk_tokens))


def candidates(run_config, devices=None, mesh=None):
  """The chunks above the default to try: the default doubled while below the tokens per device (up to
  LARGEST_TOKENS), then those. `mesh`: the run's (`train.run.Run`); without it, built from `run_config` on
  `devices`."""
  mesh = build_mesh(run_config.mesh, devices) if mesh is None else mesh
  tokens = run_config.batch_size * run_config.seq_len // token_shards(mesh)
  chunks = []
  chunk = 2 * DEFAULT_LOSS_CHUNK_TOKENS
  while chunk < 2 * tokens and chunk <= LARGEST_TOKENS:
    chunks.append(min(chunk, tokens))
    chunk *= 2
  return chunks


def probes(lo, hi, workers):
  """Which of the chunks lo..hi (indices) a round of the search asks about: up to `workers`, spread evenly."""
  n = min(workers, hi - lo + 1)
  return sorted({lo + (i + 1) * (hi - lo + 2) // (n + 1) - 1 for i in range(n)})


def widest(base_bytes, chunks, bytes_of, workers=1):
  """The largest of `chunks` (ascending) with bytes_of(chunk, last) ≤ base_bytes (+ SAME_BYTES), else the default.
  In rounds, each asking about up to `workers` chunks at once (`train.compile.at_once`), spread evenly over those
  still in question: with one, a binary search; with as many as there are, one round. `last`: the chunk is the
  largest still in question, so that the search ends with it where it fits."""
  lo, hi, best = 0, len(chunks) - 1, DEFAULT_LOSS_CHUNK_TOKENS
  while lo <= hi:
    asked = probes(lo, hi, workers)
    sizes = at_once([functools.partial(bytes_of, chunks[i], i == hi) for i in asked], workers)
    fitting = [i for i, b in zip(asked, sizes) if b <= base_bytes + SAME_BYTES]
    if fitting:
      best, lo = chunks[fitting[-1]], fitting[-1] + 1
    over = [i for i, b in zip(asked, sizes) if b > base_bytes + SAME_BYTES]
    if over:
      hi = over[0] - 1
  return best


class ChunkSteps:
  """The search's compiles, kept: `ahead(run_config)` gives its first round's compiles of a run, for the remat plan
  to compile at once with its own (`Planner.alongside`), and the search then finds them done. `model_config`,
  `mesh`: the run's (`train.run.Run`), passed to every compile."""

  def __init__(self, devices=None, *, model_config=None, mesh=None):
    self.devices = devices
    self.resolved = dict(model_config=model_config, mesh=mesh)
    self.done = []  # (config, bytes per device, its step where compiled to run, else None)

  def compile(self, run_config, chunk, last):
    """(bytes per device of the run at `chunk`, its step where compiled to run: where `last`, or where a step
    compiled for its memory only can run, else None)."""
    config = with_loss_chunk(run_config, chunk)
    for known, total, step in self.done:
      if known == config and (step is not None or not last):
        return total, step
    step = compile_step(config, self.devices, memory_only=not last, **self.resolved)
    total = memory_plan(config, step)["total_bytes"]
    if not (last or memory_only_options(self.devices) is None):
      step = None
    self.done.append((config, total, step))
    return total, step

  def ahead(self, run_config):
    """The first round's compiles of `run_config`'s search (functions of no argument), none where it searches
    nothing."""
    auto = run_config.runtime.loss_chunk_tokens == LOSS_CHUNK_AUTO
    chunks = candidates(run_config, self.devices, self.resolved["mesh"]) if auto else []
    hi = len(chunks) - 1
    return [functools.partial(self.compile, run_config, chunks[i], i == hi)
            for i in probes(0, hi, concurrent_compiles(self.devices))]


def searches(run_config, devices=None, mesh=None):
  """Whether `resolve_loss_chunk` will compile candidates for this run."""
  return run_config.runtime.loss_chunk_tokens == LOSS_CHUNK_AUTO and bool(candidates(run_config, devices, mesh))


def resolve_loss_chunk(run_config, step=None, devices=None, log=log_on_process_0, base_bytes=None, *,
                       model_config=None, mesh=None, compiles=None):
  """(the run with `loss_chunk_tokens: auto` replaced by its chunk, the CompiledStep to run it or None where it
  must be compiled yet); other runs unchanged. `step`: the run's step compiled already (at the default chunk);
  `base_bytes`: that step's bytes per device where known (the remat plan's), so that none need be compiled.
  `model_config`, `mesh`: the run's (`train.run.Run`), passed to every compile; `compiles`: the ChunkSteps that
  compiled some ahead."""
  if run_config.runtime.loss_chunk_tokens != LOSS_CHUNK_AUTO:
    return run_config, step
  base = with_loss_chunk(run_config, DEFAULT_LOSS_CHUNK_TOKENS)
  chunks = candidates(run_config, devices, mesh)
  if not chunks:
    return base, step
  compiles = compiles or ChunkSteps(devices, model_config=model_config, mesh=mesh)
  if base_bytes is None:
    step = step or compile_step(base, devices, model_config=model_config, mesh=mesh)
    base_bytes = memory_plan(base, step)["total_bytes"]
  steps = {}  # the candidates compiled to run

  def bytes_of(chunk, last):
    total, steps[chunk] = compiles.compile(run_config, chunk, last)
    log(f"  loss chunk {chunk} tokens: {size(total)} per device ({size(base_bytes)} at "
        f"{DEFAULT_LOSS_CHUNK_TOKENS})")
    return total

  chunk = widest(base_bytes, chunks, bytes_of, concurrent_compiles(devices))
  log(f"loss chunk auto: {chunk} tokens per device (of {DEFAULT_LOSS_CHUNK_TOKENS} to {chunks[-1]}, the largest whose "
      "step needs no more memory)")
  return (base, step) if chunk == DEFAULT_LOSS_CHUNK_TOKENS else (with_loss_chunk(run_config, chunk), steps[chunk])
