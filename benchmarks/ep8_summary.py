"""The EP=8 headline line from a `moe_layer` results file run on eight GPUs and a `train_compare` results file.

    python -m benchmarks.ep8_summary [--layer benchmarks/results/moe_layer.json]
                                     [--train benchmarks/results/train_compare.json] [--ring ring_expert]

Means are over every (shape, tokens per GPU) point where the ring and both all-to-alls ran on 8 GPUs.
"""

import argparse
import json
import os
import statistics

from benchmarks.harness import RESULTS


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


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--layer", default=os.path.join(RESULTS, "moe_layer.json"))
  parser.add_argument("--train", default=os.path.join(RESULTS, "train_compare.json"))
  parser.add_argument("--ring", default="ring_expert")
  args = parser.parse_args()
  rows = json.load(open(args.layer))["rows"]
  print(ep8_summary(rows, json.load(open(args.train)), args.ring))


if __name__ == "__main__":
  main()
