"""Where the training step's time goes: the trainer's step, profiled, its device time tabulated by part of the model.

    python -m benchmarks.train_step --config NAME|FILE [--steps N] [--warmup N] [--head per_token] [--out JSON] \
        [key=value ...]

Runs `relaymoe-train` (same config and `key=value` overrides; its step as it trains, `runtime.remat=auto` planned as
there) for `--warmup` steps, then traces `--steps` more with `jax.profiler` (`relaymoe-train --profile`), and
tabulates the first device's kernel time per step by part: LM head and loss, attention, MoE grouped matmuls, MoE
other, dense projections, norms/RoPE/other, optimizer, copies, communication, and idle (the step's wall time less
the time any kernel ran), with tokens/s and MFU as the trainer computes them. Parts come from the name scopes in
the HLO's op metadata (`train.profile.step_parts`). Writes JSON (the table beside it, and each part's costliest HLO ops) to
benchmarks/results/train_step_NAME_BxS.json, NAME the config's and the dispatcher's unless it is the expert ring
(`ep8`, `ep8_a2a`); the last line is `summary: train_step NAME BxS mfu=... head_ms=...`. `--head per_token` steps
with the loss head the trainer had before it computed the mean's gradient in the forward pass: the per-token chunked
cross-entropy, whose backward recomputes the logits (`Qwen3MoE.cross_entropy_and_aux`), then its mean; with
`runtime.loss_chunk_tokens=1024` it is the trainer's step before `loss_chunk_tokens: auto` (NAME ends in
`_per_token_head`).
"""

import argparse
import contextlib
import json
import os
import pathlib
import tempfile

import jax
import jax.numpy as jnp

from benchmarks import harness
from models.loss import mean_over_targets
from models.qwen3.model import Qwen3MoE
from train import cli
from train.profile.step_parts import render

HEADS = ("forward_gradient", "per_token")


def _parse(argv):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", required=True, help="run config: a YAML path or a name under configs/runs/")
  parser.add_argument("--steps", type=int, default=3, help="steps to profile")
  parser.add_argument("--warmup", type=int, default=2, help="steps before the profile")
  parser.add_argument("--out", help="results JSON (default benchmarks/results/train_step_CONFIG_BxS.json)")
  parser.add_argument("--run-dir", help="the training run's directory, trace included (default: a temporary one)")
  parser.add_argument("--head", choices=HEADS, default=HEADS[0],
                      help="the trainer's loss head, or the per-token one it had before (see the module's doc)")
  parser.add_argument("overrides", nargs="*", metavar="key=value")
  return parser.parse_intermixed_args(argv)


@contextlib.contextmanager
def loss_head(head):
  """The trainer steps with `head` while inside: its own (`forward_gradient`), or `per_token`."""
  if head == "forward_gradient":
    yield
    return
  own = Qwen3MoE.mean_cross_entropy_and_aux

  def per_token_mean(model, tokens_BS, labels_BS, segment_ids_BS=None, positions_BS=None, weights_BS=None):
    ce_BS, aux = model.cross_entropy_and_aux(tokens_BS, labels_BS, segment_ids_BS, positions_BS)
    return mean_over_targets(ce_BS, None if weights_BS is None else weights_BS.astype(jnp.float32)), aux

  Qwen3MoE.mean_cross_entropy_and_aux = per_token_mean
  try:
    yield
  finally:
    Qwen3MoE.mean_cross_entropy_and_aux = own


def profile(config, warmup, steps, overrides, run_dir):
  """(the profile's parts.json, the run's run_config.json) of a trainer run profiling steps warmup..+steps."""
  cli.main(["--config", config, "--steps", str(warmup + steps), "--profile", f"{warmup}:{steps}", "--out", run_dir,
            "--overwrite", "checkpoint_every=0", "tensorboard=false", f"log_every={warmup + steps}", *overrides])
  run = pathlib.Path(run_dir)
  parts = sorted(run.glob("profile/**/parts.json"))[0]
  return json.loads(parts.read_text()), json.loads((run / "run_config.json").read_text())


def run_name(config, dispatcher, head=HEADS[0]):
  """The config's name, the dispatcher's unless it is the expert ring and the loss head's unless it is the trainer's:
  ep8, ep8_a2a (all-to-all), ep8_ring_token, ep8_a2a_per_token_head."""
  tag = {"ring_expert": "", "all_to_all": "_a2a"}.get(dispatcher, f"_{dispatcher}")
  return os.path.splitext(os.path.basename(config))[0] + tag + ("" if head == HEADS[0] else f"_{head}_head")


def summary(name, shape, result):
  parts = result["parts"]
  mfu = "nan" if result["mfu"] is None else f"{result['mfu']:.3f}"
  return (f"summary: train_step {name} {shape} mfu={mfu} tokens_per_s={result['tokens_per_s']:.0f} "
          f"step_ms={result['step_ms']:.1f} head_ms={parts['lm_head']['ms']:.1f} "
          f"moe_ms={parts['moe_matmul']['ms'] + parts['moe_other']['ms']:.1f} "
          f"moe_matmul_ms={parts['moe_matmul']['ms']:.1f} attention_ms={parts['attention']['ms']:.1f} "
          + (f"deltanet_ms={parts['deltanet']['ms']:.1f} " if parts.get("deltanet", {}).get("ms") else "")
          + f"idle_ms={result['idle_ms']:.1f}")


def main(argv=None):
  args = _parse(argv)
  overrides = args.overrides
  if args.head != HEADS[0] and not any(o.startswith("compilation_cache_dir=") for o in overrides):
    overrides = [*overrides, "compilation_cache_dir=''"]  # the plan cache keys on the code, not on this patch
  with tempfile.TemporaryDirectory() as scratch, loss_head(args.head):
    result, run = profile(args.config, args.warmup, args.steps, overrides, args.run_dir or scratch)
  name = run_name(args.config, run["run"]["runtime"]["dispatcher"], args.head)
  shape = f"{run['run']['batch_size']}x{run['run']['seq_len']}"
  path = args.out or os.path.join(harness.RESULTS, f"train_step_{name}_{shape}.json")
  meta = dict(harness.machine(jax), command=harness.command_line("train_step", argv), config=args.config,
              overrides=args.overrides, head=args.head, warmup=args.warmup, steps=args.steps, mesh=run["mesh"],
              runtime=run["run"]["runtime"], remat_plan=run["remat_plan"], compile_s=run["compile_s"])
  harness.write_json(dict(meta=meta, profile=result), path)
  text = "\n".join([f"# {meta['command']}", f"# {meta['machine']}, JAX {meta['jax']}, mesh {meta['mesh']}", "",
                    render(result, f"Train step {name} {shape}, kernel time per step on the first device, "
                                   f"{args.steps} steps after {args.warmup}:"), "", summary(name, shape, result)])
  print(harness.write_table(text, path))


if __name__ == "__main__":
  main()
