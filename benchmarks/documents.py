"""What document masking and the held-out loss cost: the same run on packed documents with masking on and off.

    python -m benchmarks.documents --config ep8 [--steps 12] [--mean-doc 1024] [--tokens 8000000] [key=value ...]

Writes a token file of documents of mixed lengths (exponential, mean `--mean-doc` tokens, at least 16; random ids,
each document ended by an EOS id), then trains `--steps` steps from it twice, each a separate `relaymoe-train`
process: `data.document_masking=true` and `false`, both with a held-out loss (`eval.fraction`, evaluated at half
the steps and at the last). Prints tokens/s and MFU of each (the median over logged windows after the first), their
ratio, and the eval pass's seconds per 1M tokens read (the last evaluation: the first also compiles); writes JSON to
benchmarks/results/documents_CONFIG_BxS.json (`_docN` added for a mean other than 1024), its last line
`summary: documents ...`.
"""

import argparse
import importlib.metadata
import json
import os
import platform
import statistics

import numpy as np

from benchmarks import harness
from benchmarks.train_compare import train
from train.config import load_run_config
from train.sources import model_config_for

MEAN_DOC = 1024  # tokens: the default documents' mean length


def write_documents(path, num_tokens, vocab_size, eos, mean_doc, seed=0):
  """A uint32 token file of documents (exponential lengths of mean `mean_doc`, at least 16), each ended by `eos`."""
  rng = np.random.default_rng(seed)
  lengths = np.maximum(rng.exponential(mean_doc, size=2 * num_tokens // mean_doc + 16).astype(np.int64), 16)
  lengths = lengths[:np.searchsorted(np.cumsum(lengths + 1), num_tokens) + 1]
  tokens = rng.integers(0, vocab_size - 1, size=int((lengths + 1).sum()), dtype=np.uint32)
  tokens[tokens >= eos] += 1  # no document holds the EOS id
  tokens[np.cumsum(lengths + 1) - 1] = eos
  tokens.tofile(path)
  return dict(tokens=int(tokens.size), documents=int(lengths.size), mean_doc_tokens=float(lengths.mean()))


def summarize(records, eval_tokens):
  """tokens/s and MFU (median of the logged windows after the first) and the last evaluation of one run, its time
  per 1M of the `eval_tokens` it reads (its loss counts fewer: none across a document boundary)."""
  windows = [r for r in records if "tokens_per_s" in r][1:]
  evals = [r for r in records if "eval_loss" in r]
  last = evals[-1] if evals else {}
  return dict(tokens_per_s=statistics.median(r["tokens_per_s"] for r in windows) if windows else None,
              mfu=statistics.median(r["mfu"] for r in windows) if windows and windows[0]["mfu"] else None,
              peak_gib=max(r["peak_memory_bytes"] for r in windows) / 2**30 if windows else None,
              eval_s=last.get("eval_s"), eval_tokens=last.get("eval_tokens"), eval_loss=last.get("eval_loss"),
              eval_s_per_1m_tokens=last["eval_s"] / eval_tokens * 1e6 if last else None)


def _machine(run_config_path):
  """Versions and devices as the trainer saw them (this process starts no JAX backend: the runs need the GPU)."""
  try:
    with open(run_config_path) as fh:
      run = json.load(fh)
    devices = dict(devices=run["devices"], backend=run["backend"])
  except (OSError, ValueError, KeyError):
    devices = {}
  return dict(python=platform.python_version(), jax=importlib.metadata.version("jax"), **devices)


def render(name, shape, data, runs):
  lines = [f"Document masking on and off, {name} {shape}, {data['documents']} documents of mean "
           f"{data['mean_doc_tokens']:.0f} tokens:", "",
           "| document masking | tokens/s | MFU | peak GiB | eval s per 1M tokens | eval loss |",
           "|---|---|---|---|---|---|"]
  for masking, run in runs.items():
    if run.get("error"):
      lines.append(f"| {masking} | error: {run['error']} | | | | |")
      continue
    mfu = "" if run["mfu"] is None else f"{100 * run['mfu']:.1f}%"
    lines.append(f"| {masking} | {run['tokens_per_s']:.0f} | {mfu} | {run['peak_gib']:.2f} | "
                 f"{run['eval_s_per_1m_tokens']:.2f} | {run['eval_loss']:.4f} |")
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", required=True, help="run config: a YAML path or a name under configs/runs/")
  parser.add_argument("--steps", type=int, default=12)
  parser.add_argument("--log-every", type=int, default=2)
  parser.add_argument("--mean-doc", type=int, default=MEAN_DOC, help="mean document length in tokens")
  parser.add_argument("--tokens", type=int, default=8_000_000, help="tokens in the generated file")
  parser.add_argument("--eval-batches", type=int, default=4)
  parser.add_argument("--work", default="/tmp/relaymoe_documents")
  parser.add_argument("--out", help="results JSON (default benchmarks/results/documents_CONFIG_BxS.json)")
  parser.add_argument("overrides", nargs="*", metavar="key=value")
  args = parser.parse_args(argv)
  run_config = load_run_config(args.config, args.overrides)
  model_config = model_config_for(run_config)
  shape = f"{run_config.batch_size}x{run_config.seq_len}"
  os.makedirs(args.work, exist_ok=True)
  path = os.path.join(args.work, "documents.u32")
  eos = model_config.vocab_size - 1
  data = write_documents(path, args.tokens, model_config.vocab_size, eos, args.mean_doc)
  common = [*args.overrides, "data.kind=tokens", f"data.path={path}", "data.token_dtype=uint32",
            f"data.eos_token={eos}", "checkpoint_every=0", "eval.fraction=0.05",
            f"eval.every={max(args.steps // 2, 1)}", f"eval.batches={args.eval_batches}"]
  runs = {}
  for masking in ("true", "false"):
    records, error = train(run_config.runtime.dispatcher, args.config, args.steps,
                           [*common, f"data.document_masking={masking}"], os.path.join(args.work, masking),
                           log_every=args.log_every)
    runs[masking] = {"error": error} if error else summarize(
        records, args.eval_batches * run_config.batch_size * run_config.seq_len)
    print(f"document_masking={masking}: {runs[masking]}", flush=True)
  result = dict(config=args.config, shape=shape, overrides=args.overrides, steps=args.steps, data=data, runs=runs,
                machine=_machine(os.path.join(args.work, "true", "run_config.json")))
  ok = all(not r.get("error") for r in runs.values())
  ratio = runs["true"]["tokens_per_s"] / runs["false"]["tokens_per_s"] if ok else None
  result["masked_over_unmasked"] = ratio
  doc = "" if args.mean_doc == MEAN_DOC else f"_doc{args.mean_doc}"
  out = args.out or os.path.join(harness.RESULTS, f"documents_{os.path.basename(args.config)}_{shape}{doc}.json")
  table = render(args.config, shape, data, runs)
  per_1m = runs["true"].get("eval_s_per_1m_tokens")
  summary = (f"summary: documents {args.config} {shape} "
             f"masked_over_unmasked={'nan' if ratio is None else f'{ratio:.3f}'} "
             f"eval_s_per_1m_tokens={'nan' if per_1m is None else f'{per_1m:.2f}'} mean_doc={args.mean_doc}")
  harness.write_json(result, out)
  machine = ", ".join(f"{k} {v}" for k, v in result["machine"].items())
  harness.write_table(f"# {harness.command_line('documents', argv)}\n# {machine}\n\n{table}\n\n{summary}", out)
  print(table, summary, sep="\n\n")
  return 0 if ok else 1


if __name__ == "__main__":
  raise SystemExit(main())
