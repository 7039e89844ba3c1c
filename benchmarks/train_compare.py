"""Train the same model from the same seed with two dispatchers and compare loss curves, speed and memory.

    python -m benchmarks.train_compare [--config gpu] [--steps 200] [--dispatchers ring_expert,all_to_all]
                                       [--seq-search] [key=value ...]
    python -m benchmarks.train_compare --ep8-summary [--layer benchmarks/results/moe_layer.json]
                                       [--out benchmarks/results/train_compare.json] [--ring ring_expert]

Each run is a separate `relaymoe-train` process (so allocator peaks do not mix) writing its own metrics.jsonl. The
loss curves of exact dispatchers must agree up to floating-point noise (RelayMoE Fig. 18). `--seq-search` then
doubles seq_len per dispatcher until a run fails, to find the longest sequence each one trains. Prints a table,
writes JSON (and a PNG of the curves where matplotlib is installed) under benchmarks/results/. `--ep8-summary`
condenses a `moe_layer` results file run on eight GPUs and this benchmark's results into the EP=8 headline line:
means over every (shape, tokens per GPU) point where the ring and both all-to-alls ran on 8 GPUs.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

from benchmarks import harness


def train(dispatcher, config, steps, overrides, out_dir, log_every=1):
  """One relaymoe-train run; returns (its metrics records, None), or (None, the trainer's last line of error
  output) where it failed: a step that does not fit (the fit guard's message), out of memory, a bad override."""
  # --overwrite: each run starts afresh, also in a --work directory of an earlier comparison.
  cmd = [sys.executable, "-m", "train.cli", "--config", config, "--steps", str(steps), "--out", out_dir, "--overwrite",
         f"runtime.dispatcher={dispatcher}", f"log_every={log_every}", f"checkpoint_every={steps}", "tensorboard=false",
         *overrides]
  proc = subprocess.run(cmd, cwd=harness.REPO, capture_output=True, text=True)
  path = os.path.join(out_dir, "metrics.jsonl")
  if proc.returncode != 0 or not os.path.exists(path):
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    return None, lines[-1] if lines else f"exit status {proc.returncode}"
  with open(path) as fh:
    return [json.loads(line) for line in fh], None


def longest_sequence(dispatcher, config, overrides, out_root, start=1024, limit=1 << 20):
  """The largest seq_len (doubling from `start`) that trains 3 steps, or 0."""
  best, seq = 0, start
  while seq <= limit:
    records, _ = train(dispatcher, config, 3, [*overrides, f"seq_len={seq}"],
                       os.path.join(out_root, f"seq_{dispatcher}_{seq}"), log_every=3)
    if records is None:
      break
    best, seq = seq, seq * 2
  return best


def compare(runs):
  names = list(runs)
  a, b = runs[names[0]], runs[names[1]]
  diffs = [abs(x["loss"] - y["loss"]) for x, y in zip(a, b)]
  return dict(loss_curve_max_abs_diff=max(diffs), steps_compared=len(diffs))


def plot(runs, path):
  """The loss curves, into the .png beside `path` (none without matplotlib)."""
  if harness.Figure is None:
    return None
  fig = harness.Figure(figsize=(7, 4))
  ax = fig.subplots()
  for name, records in runs.items():
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], label=name)
  ax.set(xlabel="step", ylabel="loss", title="same seed, two dispatchers")
  ax.legend()
  fig.tight_layout()
  return harness.save_figure(fig, path)


def ep8_summary(layer_rows, train_result, ring="ring_expert", gpus=8):
  by = {(r["shape"], r["tokens_per_gpu"], r["variant"]): r for r in layer_rows
        if r.get("gpus") == gpus and "error" not in r}
  points = sorted({(s, t) for s, t, v in by if v == ring
                   and (s, t, "a2a_dropless") in by and (s, t, "a2a_cf1") in by})
  if not points:
    raise ValueError(f"no point where {ring}, a2a_dropless and a2a_cf1 all ran on {gpus} GPUs")

  def mean_ratio(base, key):
    return statistics.fmean(by[(s, t, base)][key] / by[(s, t, ring)][key] for s, t in points)

  return (f"summary: ep8 speedup_vs_dropless_mean={mean_ratio('a2a_dropless', 'latency_ms'):.2f} "
          f"speedup_vs_cf1_mean={mean_ratio('a2a_cf1', 'latency_ms'):.2f} "
          f"mem_ratio_dropless_mean={mean_ratio('a2a_dropless', 'peak_bytes'):.2f} "
          f"loss_curve_max_abs_diff={train_result['loss_curve_max_abs_diff']:.3g}")


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="gpu")
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--dispatchers", default="ring_expert,all_to_all")
  parser.add_argument("--seq-search", action="store_true")
  parser.add_argument("--work", default="/tmp/relaymoe_train_compare")
  parser.add_argument("--out", default=os.path.join(harness.RESULTS, "train_compare.json"))
  parser.add_argument("--ep8-summary", action="store_true", help="print the EP=8 headline from --layer and --out")
  parser.add_argument("--layer", default=os.path.join(harness.RESULTS, "moe_layer.json"))
  parser.add_argument("--ring", default="ring_expert")
  parser.add_argument("overrides", nargs="*", metavar="key=value")
  args = parser.parse_args(argv)
  if args.ep8_summary:
    print(ep8_summary(harness.load_json(args.layer)["rows"], harness.load_json(args.out), args.ring))
    return
  dispatchers = args.dispatchers.split(",")
  if len(dispatchers) != 2:
    raise SystemExit(f"--dispatchers needs exactly two names, got {dispatchers}")
  runs = {}
  for d in dispatchers:
    records, error = train(d, args.config, args.steps, args.overrides, os.path.join(args.work, d))
    if records is None:
      raise SystemExit(f"the {d} run failed: {error}")
    runs[d] = records
  result = dict(command=harness.command_line("train_compare", argv), **compare(runs))
  for d, records in runs.items():
    tail = records[len(records) // 2:]  # past compilation and warm-up
    result[d] = dict(tokens_per_s=sum(r["tokens_per_s"] for r in tail) / len(tail),
                     tflops_per_device=sum(r["tflops_per_device"] for r in tail) / len(tail),
                     peak_memory_bytes=max(r["peak_memory_bytes"] for r in records), final_loss=records[-1]["loss"])
    if args.seq_search:
      result[d]["longest_seq_len"] = longest_sequence(d, args.config, args.overrides, args.work)
  result["curves"] = {d: [r["loss"] for r in records] for d, records in runs.items()}
  harness.write_json(result, args.out)
  plot(runs, args.out)
  lines = ["| dispatcher | tokens/s | TFLOP/s/device | peak GiB | final loss | longest seq |",
           "|---|---|---|---|---|---|"]
  for d in dispatchers:
    r = result[d]
    lines.append(f"| {d} | {r['tokens_per_s']:.0f} | {r['tflops_per_device']:.2f} | "
                 f"{r['peak_memory_bytes'] / 2**30:.2f} | {r['final_loss']:.4f} | {r.get('longest_seq_len', '—')} |")
  lines.append(f"summary: train_compare {dispatchers[0]}_vs_{dispatchers[1]} steps={args.steps} "
               f"loss_curve_max_abs_diff={result['loss_curve_max_abs_diff']:.3g}")
  print(harness.write_table("\n".join(lines), args.out))


if __name__ == "__main__":
  main()
