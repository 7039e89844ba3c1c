"""Where a jitted step's device time goes: GPU kernel time by name from a `jax.profiler` Perfetto trace.

    python -m benchmarks.trace_summary TRACE_DIR [--steps N] [--timeline]

Reads the `perfetto_trace.json.gz` that `jax.profiler.trace(dir, create_perfetto_trace=True)` writes and sums the
durations of the kernels on the first GPU, per step, grouped by kernel name and by a coarse kind (grouped matmul,
collective, scatter, gather, other fusion, copy); `compute_ms` against the same step without sends shows how much
the sends slow the compute beside them. `--timeline` lists each collective kernel with the compute that ran beside
it. Kernel time by part of the model, from the HLO's name scopes: `python -m benchmarks.train_step`.
"""

import argparse
import collections
import json

from train.profile.trace_events import device_kernels, find_trace, union_us

KINDS = (("mosaic", "grouped matmul"), ("nccl", "collective"), ("scatter", "scatter"), ("gather", "gather"),
         ("memcpy", "copy"), ("memset", "copy"), ("fusion", "fusion"))


def kind_of(name):
  lower = name.lower()
  return next((kind for key, kind in KINDS if key in lower), "other")


def _union_ms(intervals):
  return union_us(intervals) / 1e3


def _is_collective(event):
  return kind_of(event["name"]) == "collective"


def kernel_times(path, steps=1, device="GPU:0"):
  """{"by_name": [(name, ms per step, launches per step)], "by_kind": {kind: ms per step}, "busy_ms": …,
  "compute_ms": …, "exposed_collective_ms": …}: compute_ms is the kernel time outside collectives; the last is the
  time collectives run while no other kernel does, per step (the communication that compute did not hide)."""
  total, launches = collections.Counter(), collections.Counter()
  spans = {True: [], False: []}
  for e in device_kernels(path, device):
    total[e["name"]] += e["dur"] / 1e3
    launches[e["name"]] += 1
    spans[_is_collective(e)].append((e["ts"], e["ts"] + e["dur"]))
  exposed = _union_ms(spans[True] + spans[False]) - _union_ms(spans[False])
  by_kind = collections.Counter()
  for name, ms in total.items():
    by_kind[kind_of(name)] += ms / steps
  compute_ms = sum(ms for kind, ms in by_kind.items() if kind != "collective")
  return dict(by_name=[(n, round(ms / steps, 3), launches[n] // steps) for n, ms in total.most_common(40)],
              by_kind={k: round(v, 3) for k, v in by_kind.most_common()}, busy_ms=round(sum(total.values()) / steps, 3),
              compute_ms=round(compute_ms, 3), exposed_collective_ms=round(exposed / steps, 3))


def collective_timeline(path, device="GPU:0"):
  """[(start ms, duration ms, other kernels' time during it ms, name)] of each collective kernel on `device`, from
  the first kernel of the trace: where the sends sit in a step and how much compute runs beside each."""
  kernels = device_kernels(path, device)
  compute = [(e["ts"], e["ts"] + e["dur"]) for e in kernels if not _is_collective(e)]
  rows = []
  for e in filter(_is_collective, kernels):
    start, stop = e["ts"], e["ts"] + e["dur"]
    beside = _union_ms([(max(a, start), min(b, stop)) for a, b in compute if a < stop and b > start])
    rows.append((round((start - kernels[0]["ts"]) / 1e3, 3), round(e["dur"] / 1e3, 3), round(beside, 3),
                 e["name"][:60]))
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("trace_dir")
  parser.add_argument("--steps", type=int, default=1)
  parser.add_argument("--timeline", action="store_true", help="also list each collective kernel and the compute "
                      "kernel time beside it")
  args = parser.parse_args()
  path = find_trace(args.trace_dir)
  print(json.dumps(kernel_times(path, args.steps), indent=1))
  if args.timeline:
    print("| start ms | collective ms | compute beside it ms | kernel |\n|---|---|---|---|")
    for row in collective_timeline(path):
      print("| " + " | ".join(map(str, row)) + " |")


if __name__ == "__main__":
  main()
