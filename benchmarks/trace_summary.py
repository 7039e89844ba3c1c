"""Where a jitted step's device time goes: GPU kernel time by name from a `jax.profiler` Perfetto trace.

    python -m benchmarks.trace_summary TRACE_DIR [--steps N]

Reads the `perfetto_trace.json.gz` that `jax.profiler.trace(dir, create_perfetto_trace=True)` writes and sums the
durations of the kernels on the first GPU, per step, grouped by kernel name and by a coarse kind (grouped matmul,
collective, scatter, gather, other fusion, copy).
"""

import argparse
import collections
import glob
import gzip
import json
import os

KINDS = (("mosaic", "grouped matmul"), ("nccl", "collective"), ("scatter", "scatter"), ("gather", "gather"),
         ("memcpy", "copy"), ("memset", "copy"), ("fusion", "fusion"))


def find_trace(trace_dir):
  paths = sorted(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True))
  if not paths:
    raise FileNotFoundError(f"no perfetto_trace.json.gz under {trace_dir}")
  return paths[-1]


def kind_of(name):
  lower = name.lower()
  return next((kind for key, kind in KINDS if key in lower), "other")


def _union_ms(intervals):
  total, end = 0.0, float("-inf")
  for start, stop in sorted(intervals):
    if stop > end:
      total += stop - max(start, end)
      end = stop
  return total / 1e3


def kernel_times(path, steps=1, device="GPU:0"):
  """{"by_name": [(name, ms per step, launches per step)], "by_kind": {kind: ms per step}, "busy_ms": …,
  "exposed_collective_ms": …}: the last is the time collectives run while no other kernel does, per step (the
  communication that compute did not hide)."""
  events = json.load(gzip.open(path))
  events = events["traceEvents"] if isinstance(events, dict) else events
  pids = {e["pid"] for e in events
          if e.get("ph") == "M" and e.get("name") == "process_name" and device in e["args"].get("name", "")}
  total, launches = collections.Counter(), collections.Counter()
  spans = {"collective": [], "compute": []}
  for e in events:
    if e.get("ph") == "X" and e.get("pid") in pids:
      total[e["name"]] += e["dur"] / 1e3
      launches[e["name"]] += 1
      spans["collective" if kind_of(e["name"]) == "collective" else "compute"].append((e["ts"], e["ts"] + e["dur"]))
  exposed = _union_ms(spans["collective"] + spans["compute"]) - _union_ms(spans["compute"])
  by_kind = collections.Counter()
  for name, ms in total.items():
    by_kind[kind_of(name)] += ms / steps
  return dict(by_name=[(n, round(ms / steps, 3), launches[n] // steps) for n, ms in total.most_common(40)],
              by_kind={k: round(v, 3) for k, v in by_kind.most_common()}, busy_ms=round(sum(total.values()) / steps, 3),
              exposed_collective_ms=round(exposed / steps, 3))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("trace_dir")
  parser.add_argument("--steps", type=int, default=1)
  args = parser.parse_args()
  print(json.dumps(kernel_times(find_trace(args.trace_dir), args.steps), indent=1))


if __name__ == "__main__":
  main()
