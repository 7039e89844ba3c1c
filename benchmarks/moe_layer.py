"""One MoE layer, fwd+bwd, bf16, on the GPUs of one host: the rings against all-to-all (dropless and capacity 1.0).

    python -m benchmarks.moe_layer [--shape qwen3_30b|grid|CONFIG|'CONFIG*L',...] [--tokens 16384,32768,65536]
                                   [--variants ...] [--parallel N]
    python -m benchmarks.moe_layer --ep-scaling          # compile-only memory at EP 8–64 on emulated CPU devices
    python -m benchmarks.moe_layer --merge A.json B.json --out C.json   # one table from several runs
    python -m benchmarks.moe_layer --plot FILE.json      # PNG plots from a results file

Every variant runs in its own process (so allocator peaks do not mix) over all local GPUs as one expert ring, on
the same inputs (tokens, a softmax router's top-k, SwiGLU experts) and the same grouped-matmul backend; a shape
`CONFIG*L` runs L such layers in sequence (own experts, shared routing, residual between them). Reported:
median fwd+bwd latency, peak device memory (`memory_stats`), compiled temporaries, compile time, useful TFLOP/s
per GPU (model FLOPs of the experts, no recompute) and ratios against each all-to-all. Two more rows give the
overlap measure: `ring_nocomm` (the ring's own hops, chunks and kernels with every send replaced by keeping the
local payload: its compute alone) and `transfer` (the ring's transfers alone); hop_overlap = ring latency / max
of the two. `compute_floor` is the ring of one: all experts on one GPU, no transfers. A variant `NAME@R1/R2` runs
NAME with the chunk-size ladder (R1, R2).
Up to --parallel variant processes compile at once (compilation is CPU work, most of a process's minute); they
then measure one at a time while the others wait, so no measurement shares the GPU with anything. A batch
measures only once all of it has compiled: keep slow compiles (E384) out of a batch of fast ones. A variant with no
result 300 s after it starts measuring is killed and reported as such; one whose compiled buffers exceed a GPU's
allocator limit (MEM_FRACTION of the GPU, unless XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise) is reported out of
memory without running.
Writes JSON (after every row) and a table under benchmarks/results/.

This driver imports no JAX: `benchmarks.moe_layer_worker` compiles and measures, one process per variant.
"""

import argparse
import os
import pathlib
import sys

from benchmarks import harness

# models.config's CONFIG_DIR / "models": importing models.config would import JAX (its errors come from relaymoe_jax).
MODEL_CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs" / "models"

MODEL_OF_SHAPE = {"qwen3_30b": "qwen3-30b-a3b"}  # other shapes are named as their configs/models/ file
GRID = "grid"  # --shape grid: every grid-* model config, the paper's scaling grid (Table 3)
SUMMARY_SHAPE, SUMMARY_TOKENS = "qwen3_30b", 65536
MEASURE_TIMEOUT_S = 300  # per variant, from "go" to its row (the slowest measured so far took ~20 s)
WORKER = "benchmarks.moe_layer_worker"  # the JAX side: one variant process (`--one`), the machine (`--describe`)


def stack_depth(name):
  """L of a shape `NAME*L`: L MoE layers in sequence, each with its own experts and the residual between them
  (so one layer's weight-gradient send can overlap the backward of the layer below it); 1 for `NAME`."""
  depth = name.partition("*")[2]
  if depth and not (depth.isdigit() and int(depth) >= 1):
    raise ValueError(f"shape {name!r}: the layer count after '*' must be a positive integer")
  return int(depth or 1)


def shape_names(arg):
  """The shapes of --shape: a comma list, where `grid` stands for every grid-* model config (the worker's
  `--describe` checks that each names a model config)."""
  grid = sorted(p.stem for p in MODEL_CONFIGS.glob("grid-*.yaml"))
  names = [n for part in arg.split(",") for n in (grid if part == GRID else [part])]
  for name in names:
    stack_depth(name)
  return names


VARIANTS = {
    "ring_expert": ("ring_expert", {}),
    "ring_token": ("ring_token", {}),
    "auto": ("auto", {}),
    "a2a_dropless": ("all_to_all", {}),
    "a2a_cf1": ("all_to_all", {"capacity_factor": 1.0}),
    "compute_floor": ("ring_expert", {}),  # on one GPU with all E experts: the ring's compute with no transfers
    "compute_floor_keep": ("ring_expert", {"keep_gate_up": True}),  # the same, the backward not recomputing gate/up
    "ring_nocomm": ("ring_expert", {}),  # ring_expert with every send replaced by the local payload
    "ring_expert_reverse": ("ring_expert", {"reverse_backward": True}),
    "ring_expert_home": ("ring_expert", {"reverse_backward": False}),  # backward in forward order, home send last
}
RING_SCHEDULES = ("ring_expert", "ring_expert_reverse", "ring_expert_home")
TRANSFER = "transfer"  # the ring's fwd+bwd transfers alone (weights; weights + gradients), no compute


def variant_options(variant):
  """(dispatcher, options) of a variant; `NAME@R1/R2/…` is NAME with the chunk-size ladder (R1, R2, …)."""
  name, _, ladder = variant.partition("@")
  dispatcher, options = VARIANTS[name]
  return dispatcher, dict(options, chunk_rows=tuple(map(int, ladder.split("/")))) if ladder else options


def _worker_command(iters, profile_dir, xla_options):
  def command(job):
    return [sys.executable, "-m", WORKER, "--one", job["variant"], "--shape", job["shape"],
            "--tokens", str(job["tokens_per_gpu"]), "--iters", str(iters)] + \
        (["--profile", profile_dir] if profile_dir else []) + [f"--xla-option={option}" for option in xla_options]
  return command


def run_isolated(jobs, iters, profile_dir=None, parallel=1, xla_options=()):
  """Yields a row per (shape, variant, tokens), each variant in its own process (`benchmarks.moe_layer_worker
  --one`), so allocator peaks do not mix: `parallel` processes compile together, then measure one after another."""
  jobs = [dict(variant=variant, shape=shape, tokens_per_gpu=tokens) for shape, variant, tokens in jobs]
  yield from harness.run_isolated(jobs, _worker_command(iters, profile_dir, xla_options), parallel,
                                  MEASURE_TIMEOUT_S, harness.child_env())


def describe(shapes=(), xla_options=()):
  """The worker's `--describe` in a child: the machine, the compiler options, each shape's (D, F, E, K)."""
  return harness.json_child([sys.executable, "-m", WORKER, "--describe", "--shape", ",".join(shapes)]
                            + [f"--xla-option={option}" for option in xla_options], harness.child_env())


def ep_scaling(tokens_per_device=2048, num_experts=128, ep_sizes=(8, 16, 32, 64)):
  """Compile-only temporaries at fixed tokens per device as EP grows (the paper's EP-scaling setup, on CPU).

  Scaled so that a device's tokens outweigh its experts' weights as at real size (Qwen3-30B at EP 64: 16384 tokens
  × D 2048 against 2 experts × 3 × D × F 768, about 3.4 : 1; here 2048 × 256 against 2 × 3 × 256 × 96,
  3.6 : 1)."""
  rows = []
  for n in ep_sizes:
    code = ("import json, os; from benchmarks.moe_memory import LayerShape, expert_mesh, fwd_bwd_memory; "
            f"s = LayerShape(tokens_per_device={tokens_per_device}, d_model=256, d_ff=96, num_experts={num_experts}, "
            "top_k=8); m = expert_mesh(" + str(n) + "); "
            "print(json.dumps({v: fwd_bwd_memory(v, s, m)['temp_bytes'] for v in "
            "('ring_expert', 'a2a_dropless', 'a2a_cf1')}))")
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={n}", JAX_PLATFORMS="cpu")
    temps = harness.json_child([sys.executable, "-c", code], env)
    rows.append(dict(ep=n, num_experts=num_experts, tokens_per_device=tokens_per_device, **temps,
                     ratio_dropless=temps["a2a_dropless"] / temps["ring_expert"],
                     ratio_cf1=temps["a2a_cf1"] / temps["ring_expert"]))
    print(rows[-1], flush=True)
  return rows


def _profiled(row):
  """Grouped-matmul kernel time and exposed communication per step, from the trace (— without --profile)."""
  k = row.get("kernels")
  if not k:
    return "— | —"
  return f"{k['by_kind'].get('grouped matmul', 0.0):.1f} | {k.get('exposed_collective_ms', float('nan')):.1f}"


def overlap(rows, ring):
  """(ring latency / max(its compute alone, its transfers alone), compute : transfer) for a ring_expert row (or
  one of its schedules, `RING_SCHEDULES`, against the default schedule's transfers), or None.

  Compute alone is `ring_nocomm` at the same point (else the ring of one, `compute_floor`); the transfers do not
  depend on the token count, so any `transfer` row of the shape serves. 1.0 is perfect overlap."""
  def find(variant, any_tokens=False):
    return next((r for r in rows if r["variant"] == variant and r["shape"] == ring["shape"] and "error" not in r
                 and (any_tokens or r["tokens_per_gpu"] == ring["tokens_per_gpu"])), None)
  compute, transfer = find("ring_nocomm") or find("compute_floor"), find(TRANSFER, any_tokens=True)
  if not compute or not transfer:
    return None
  return (ring["latency_ms"] / max(compute["latency_ms"], transfer["latency_ms"]),
          compute["latency_ms"] / transfer["latency_ms"])


def render(rows, scaling):
  lines = ["| shape | GPUs | T/GPU | variant | ms | peak GiB | temp GiB | useful TFLOP/s/GPU | vs dropless | vs cf1 | "
           "overlap (compute:transfer) | GEMM ms | exposed comm ms |", "|" + "---|" * 13]
  by = {(r["shape"], r["tokens_per_gpu"], r["variant"], r.get("gpus")): r for r in rows}
  for r in rows:
    if "error" in r:
      lines.append(f"| {r['shape']} | {r.get('gpus')} | {r['tokens_per_gpu']} | {r['variant']} | {r['error'][:40]} "
                   "| | | | | | | | |")
      continue
    ratios = []
    for base in (() if r["variant"].startswith(("ring_nocomm", TRANSFER)) else ("a2a_dropless", "a2a_cf1")):
      b = by.get((r["shape"], r["tokens_per_gpu"], base, r.get("gpus")))
      ratios.append(f"{b['latency_ms'] / r['latency_ms']:.2f}×" if b and "latency_ms" in b else "—")
    ratios = ratios or ["—", "—"]
    ov = overlap(rows, r) if r["variant"] in RING_SCHEDULES else None
    ov = f"{ov[0]:.2f} ({ov[1]:.1f}:1)" if ov else "—"
    lines.append(f"| {r['shape']} | {r.get('gpus')} | {r['tokens_per_gpu']} | {r['variant']} | {r['latency_ms']:.1f} | "
                 f"{r['peak_bytes'] / 2**30:.2f} | {r['temp_bytes'] / 2**30:.2f} | "
                 f"{r['useful_tflops_per_gpu']:.0f} | {ratios[0]} | {ratios[1]} | {ov} | {_profiled(r)} |")
  profiled = [r for r in rows if r.get("kernels")]
  if profiled:
    kinds = sorted({k for r in profiled for k in r["kernels"]["by_kind"]}, key=lambda k: (k != "grouped matmul", k))
    lines += ["", "Kernel time per step on the first GPU, ms, by kind (`benchmarks.trace_summary`):", "",
              "| shape | T/GPU | variant | " + " | ".join(kinds)
              + " | all kernels | all but grouped matmul | no kernel running (one GPU: ms − all kernels) |",
              "|---|---|---|" + "---|" * (len(kinds) + 3)]
    for r in profiled:
      k = r["kernels"]
      lines.append(f"| {r['shape']} | {r['tokens_per_gpu']} | {r['variant']} | "
                   + " | ".join(f"{k['by_kind'].get(kind, 0.0):.1f}" for kind in kinds)
                   + f" | {k['busy_ms']:.1f} | {k['busy_ms'] - k['by_kind'].get('grouped matmul', 0.0):.1f} | "
                   + (f"{r['latency_ms'] - k['busy_ms']:.1f} |" if r["gpus"] == 1 else "— |"))
  if scaling:
    lines += ["", "| EP | E | T/dev | ring MiB | dropless MiB | cf1 MiB | dropless/ring | cf1/ring |",
              "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {s['ep']} | {s['num_experts']} | {s['tokens_per_device']} | {s['ring_expert'] / 2**20:.1f} | "
              f"{s['a2a_dropless'] / 2**20:.1f} | {s['a2a_cf1'] / 2**20:.1f} | {s['ratio_dropless']:.2f} | "
              f"{s['ratio_cf1']:.2f} |" for s in scaling]
  return "\n".join(lines)


def summary(rows, scaling, shape=SUMMARY_SHAPE, tokens=SUMMARY_TOKENS):
  at = [r for r in rows if r["shape"] == shape and r["tokens_per_gpu"] == tokens and "error" not in r]
  ring = next((r for r in at if r["variant"] == "ring_expert"), None)
  if not ring:
    return None
  by = {r["variant"]: r for r in at if r.get("gpus") == ring.get("gpus") or r["variant"].startswith("compute_floor")}
  dropless, cf1 = by.get("a2a_dropless"), by.get("a2a_cf1")

  def floor(variant):
    return f"{by[variant]['useful_tflops_per_gpu']:.1f}" if variant in by else "nan"

  def ratio(base, key):
    return f"{base[key] / ring[key]:.2f}" if base and ring[key] else "nan"

  ov = overlap(rows, ring)
  ep = {s["ep"]: f"{s['ratio_cf1']:.2f}" for s in scaling}
  return (f"summary: moe_layer gpus={ring['gpus']} shape={shape} tokens={tokens} "
          f"speedup_vs_dropless={ratio(dropless, 'latency_ms')} speedup_vs_cf1={ratio(cf1, 'latency_ms')} "
          f"peak_mem_ratio_dropless={ratio(dropless, 'peak_bytes')} peak_mem_ratio_cf1={ratio(cf1, 'peak_bytes')} "
          f"useful_tflops={ring['useful_tflops_per_gpu']:.1f} hop_overlap={f'{ov[0]:.2f}' if ov else 'nan'} "
          f"ep8_mem_ratio_cf1={ep.get(8, 'nan')} ep64_mem_ratio_cf1={ep.get(64, 'nan')} "
          f"floor_useful_tflops={floor('compute_floor')} floor_keep_useful_tflops={floor('compute_floor_keep')}")


def plot(path):
  """Latency and peak memory of the Qwen3-30B layer against tokens per GPU (bars per variant when the file has one
  token count; a variant's out-of-memory points in its legend), and compile-only memory against EP."""
  if harness.Figure is None:
    raise SystemExit("--plot needs matplotlib")
  data = harness.load_json(path)
  ours = [r for r in data["rows"] if r["shape"] == SUMMARY_SHAPE and r["variant"] != TRANSFER]
  rows = [r for r in ours if "error" not in r]
  oom = {}
  for r in ours:
    if r.get("error") == "out of memory":
      oom.setdefault(r["variant"], []).append(str(r["tokens_per_gpu"]))
  fig = harness.Figure(figsize=(16, 5))
  axes = fig.subplots(1, 3)
  panels = ((0, "latency_ms", "fwd+bwd ms", "latency"), (1, "peak_bytes", "peak GiB", "peak memory"))
  scale = dict(latency_ms=1.0, peak_bytes=2.0**-30)
  variants = list(dict.fromkeys(r["variant"] for r in rows))
  colors = {v: f"C{i}" for i, v in enumerate(variants)}
  tokens = sorted({r["tokens_per_gpu"] for r in rows})
  for i, key, label, what in panels:
    if len(tokens) == 1:
      values = {r["variant"]: r[key] * scale[key] for r in rows}
      axes[i].barh(variants, [values[v] for v in variants], color=[colors[v] for v in variants])
      axes[i].set(xlabel=label, title=f"Qwen3-30B MoE layer, {tokens[0]} tokens/GPU: {what}")
      continue
    for variant in variants:
      pts = sorted((r["tokens_per_gpu"], r[key] * scale[key]) for r in rows if r["variant"] == variant)
      note = f" (OOM at {', '.join(oom[variant])})" if variant in oom else ""
      axes[i].plot(*zip(*pts), "o-", label=variant + note, color=colors[variant])
    axes[i].set(xlabel="tokens per GPU", ylabel=label, title=f"Qwen3-30B MoE layer, fwd+bwd: {what}",
                xscale="log", yscale="log")
    axes[i].set_xticks(tokens, [f"{t // 1024}K" for t in tokens])
    axes[i].minorticks_off()
    axes[i].yaxis.set_major_locator(harness.ticker.LogLocator(subs=(1, 2, 5)))
    axes[i].yaxis.set_major_formatter(harness.ticker.ScalarFormatter())
  scaling = (data.get("ep_scaling") or {}).get("rows", [])
  for key in ("ring_expert", "a2a_dropless", "a2a_cf1"):
    axes[2].plot([s["ep"] for s in scaling], [s[key] / 2**20 for s in scaling], "o-", label=key)
  axes[2].set(xlabel="EP (emulated CPU devices)", ylabel="compiled temporaries MiB", xscale="log", yscale="log",
              title="memory vs EP (fixed tokens/device)")
  axes[2].set_xticks([s["ep"] for s in scaling], [str(s["ep"]) for s in scaling], minor=False)
  axes[2].minorticks_off()
  axes[2].legend()
  fig.tight_layout()
  if len(tokens) > 1:  # one legend for the two panels, below them
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=4, fontsize=8)
    fig.subplots_adjust(bottom=0.22)
  print(harness.save_figure(fig, path))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shape", default=SUMMARY_SHAPE,
                      help=f"comma list of model configs (`NAME*L`: L layers of NAME); `{GRID}`: the paper's grid")
  parser.add_argument("--tokens", default="16384,32768,65536")
  parser.add_argument("--variants", default=",".join([*VARIANTS, TRANSFER]))
  parser.add_argument("--iters", type=int, default=5)
  parser.add_argument("--parallel", type=int, default=max(1, min(8, (os.cpu_count() or 1) // 4)),
                      help="variant processes compiling at once (they measure one at a time)")
  parser.add_argument("--ep-scaling", action="store_true")
  parser.add_argument("--skip-layers", action="store_true", help="only --ep-scaling")
  parser.add_argument("--plot")
  parser.add_argument("--merge", nargs="+", metavar="JSON", help="combine results files into --out")
  parser.add_argument("--profile", metavar="DIR", help="also trace each variant under DIR and report kernel time")
  parser.add_argument("--xla-option", action="append", default=[], metavar="KEY=VALUE",
                      help="compile with this XLA option over rm.COMPILER_OPTIONS (repeatable)")
  parser.add_argument("--out", default=os.path.join(harness.RESULTS, "moe_layer.json"))
  args = parser.parse_args(argv)
  harness.parse_options(args.xla_option)  # a bad KEY=VALUE fails here, before any process starts
  if args.plot:
    plot(args.plot)
    return
  if args.merge:
    merge(args.merge, args.out)
    return
  shapes = [] if args.skip_layers else shape_names(args.shape)
  info = describe(shapes, args.xla_option)  # an unknown shape fails here
  meta = dict(command=harness.command_line("moe_layer", argv), compiler_options=info["compiler_options"],
              **info["machine"])
  rows, scaling = [], []

  def save():  # after every row, so a run stopped at its time limit keeps what it measured
    harness.write_json(dict(meta=meta, rows=rows, ep_scaling=scaling), args.out)

  if not args.skip_layers:
    tokens = list(map(int, args.tokens.split(",")))
    # the transfers do not depend on the token count: measured once per shape, at the first
    jobs = [(s, v, t) for s in shapes for t in tokens for v in args.variants.split(",")
            if v != TRANSFER or t == tokens[0]]
    for row in run_isolated(jobs, args.iters, args.profile, args.parallel, args.xla_option):
      rows.append(row)
      print(row, flush=True)
      save()
  if args.ep_scaling:
    scaling = dict(meta, measure="compile-only temp_size_in_bytes", rows=ep_scaling())
  save()
  print(write_table(dict(meta=meta, rows=rows, ep_scaling=scaling), args.out))


def _merge_key(row):
  """A row's point: a `transfer` row does not depend on the token count, so any later one of its shape replaces it;
  rows of another GPU count are other points (the all-to-all on one GPU beside two)."""
  return (row["shape"], row["variant"], None if row["variant"] == TRANSFER else row["tokens_per_gpu"],
          row.get("gpus"))


def merge(paths, out):
  """One results file from several runs (e.g. one per device call): rows by shape and token count, a later run's
  row replacing an earlier one of the same shape, variant and token count (a `transfer` row, which does not depend
  on the token count, any earlier one of its shape); the last EP-scaling found."""
  files = [harness.load_json(path) for path in paths]
  runs = [run for data in files for run in harness.runs_of(data["meta"])]  # a merged file brings its runs
  rows = harness.merge_by_key([r for data in files for r in data["rows"]], _merge_key)
  scaling = next((data["ep_scaling"] for data in reversed(files) if data.get("ep_scaling")), {})
  ordered = sorted(rows, key=lambda r: (r["shape"] != SUMMARY_SHAPE, r["shape"], r["tokens_per_gpu"]))
  merged = dict(meta=dict(runs=runs), rows=ordered, ep_scaling=scaling)
  harness.write_json(merged, out)
  print(write_table(merged, out))


def write_table(data, out):
  """The table (runs, then rows, then EP scaling) and the summary line, into the .txt next to `out`."""
  runs = harness.runs_of(data["meta"])
  scaling = data.get("ep_scaling") or {}
  header = [f"# {m['command']}\n#   {m.get('machine', '?')}; JAX {m['jax']}, Python {m['python']}; "
            f"XLA_FLAGS={m.get('xla_flags') or '(default)'}; compiler options {m.get('compiler_options', '(none)')}"
            + (f"; GPU memory fraction {m['mem_fraction']}" if "mem_fraction" in m else "")
            + (f"; code: {m['code']}" if "code" in m else "")
            for m in runs + ([scaling] if scaling and scaling["command"] not in {r["command"] for r in runs} else [])]
  line = summary(data["rows"], scaling.get("rows", []))
  return harness.write_table("\n".join(header + [render(data["rows"], scaling.get("rows", []))]
                                       + ([line] if line else [])), out)


if __name__ == "__main__":
  main()
