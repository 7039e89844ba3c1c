"""One MoE layer, fwd+bwd, bf16, on the GPUs of one host: the rings against all-to-all (dropless and capacity 1.0).

    python -m benchmarks.moe_layer [--shape qwen3_30b] [--tokens 16384,32768,65536] [--variants ...]
    python -m benchmarks.moe_layer --ep-scaling          # compile-only memory at EP 8–64 on emulated CPU devices
    python -m benchmarks.moe_layer --plot FILE.json      # PNG plots from a results file

Every variant runs in its own process (so allocator peaks do not mix) over all local GPUs as one expert ring, on
the same inputs (tokens, a softmax router's top-k, SwiGLU experts) and the same grouped-matmul backend. Reported:
median fwd+bwd latency, peak device memory (`memory_stats`), compiled temporaries, useful TFLOP/s per GPU (model
FLOPs of the experts, no recompute) and ratios against each all-to-all. Two more rows give the overlap measure:
`compute_floor` (the ring on one GPU: the same compute, no transfers) and `transfer` (the ring's transfers alone);
hop_overlap = ring latency / max of the two. A variant `NAME@R1/R2` runs NAME with the chunk-size ladder (R1, R2).
Writes JSON under benchmarks/results/.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "benchmarks", "results")
SHAPES = {  # name: (D, F, E, K)
    "qwen3_30b": (2048, 768, 128, 8),
    "grid_e64_k8_f512": (2048, 512, 64, 8),
    "grid_e384_k8_f2048": (2048, 2048, 384, 8),
    "grid_e128_k16_f768": (2048, 768, 128, 16),
    "tiny": (64, 32, 16, 4),  # a CPU smoke test of the harness
}
VARIANTS = {
    "ring_expert": ("ring_expert", {}),
    "ring_token": ("ring_token", {}),
    "auto": ("auto", {}),
    "a2a_dropless": ("all_to_all", {}),
    "a2a_cf1": ("all_to_all", {"capacity_factor": 1.0}),
    "compute_floor": ("ring_expert", {}),  # on one GPU with all E experts: the ring's compute with no transfers
}
TRANSFER = "transfer"  # the ring's fwd+bwd transfers alone (weights; weights + gradients), no compute


def variant_options(variant):
  """(dispatcher, options) of a variant; `NAME@R1/R2/…` is NAME with the chunk-size ladder (R1, R2, …)."""
  name, _, ladder = variant.partition("@")
  dispatcher, options = VARIANTS[name]
  return dispatcher, dict(options, chunk_rows=tuple(map(int, ladder.split("/")))) if ladder else options


def _transfer_step(jax, jnp, rm, mesh, weights):
  """A jitted step that moves exactly what ring_expert moves (forward `ring_pass` of the fused weights, backward
  `ring_relay` of weights and their gradients), with only a trivial add per hop so nothing is optimised away."""
  from relaymoe_jax.grouped_matmul import fuse_gate_up  # noqa: PLC0415
  from relaymoe_jax.ring import ring_pass, ring_relay  # noqa: PLC0415
  n = mesh.shape[rm.EXPERT]

  def per_device(w_gate, w_up, w_down):
    own = (fuse_gate_up(w_gate, w_up), w_down)
    touch = lambda state, h, payload: state + payload[1][0, 0, 0].astype(jnp.float32)  # noqa: E731
    state = ring_pass(touch, jnp.zeros((), jnp.float32), own, axis=rm.EXPERT, n=n)
    partial = lambda state, h, payload: (state, tuple(p.astype(jnp.float32) for p in payload))  # noqa: E731
    state, acc = ring_relay(partial, state, own, axis=rm.EXPERT, n=n,
                            to_relay=lambda a: tuple(x.astype(w_down.dtype) for x in a))
    return (state + acc[1][0, 0, 0].astype(jnp.float32))[None]

  spec = jax.sharding.PartitionSpec(rm.EXPERT)
  return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec, check_vma=False))


def expert_flops(tokens, d, f, k):
  """Useful fwd+bwd FLOPs of the experts: 3 × (gate+up 2·D·2F + down 2·F·D) per token–expert pair."""
  return 3 * tokens * k * (2 * d * 2 * f + 2 * f * d)


PROFILE_STEPS = 2


def run_one(variant, shape, tokens_per_gpu, iters, profile_dir=None):
  """Measures one variant in this process; returns a dict (or the failure). With `profile_dir`, then traces
  PROFILE_STEPS more steps there and adds the first device's kernel time by kind (`benchmarks.trace_summary`)."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: PLC0415

  import relaymoe_jax as rm  # noqa: PLC0415

  d, f, e, k = SHAPES[shape]
  devices = jax.devices()[:1] if variant.startswith("compute_floor") else jax.devices()
  mesh = jax.sharding.Mesh(np.array(devices), (rm.EXPERT,))
  t = tokens_per_gpu * len(devices)
  keys = jax.random.split(jax.random.key(0), 5)
  tok, exp = NamedSharding(mesh, P(rm.EXPERT)), NamedSharding(mesh, P(rm.EXPERT))
  bf16 = jnp.bfloat16
  x = jax.device_put(jax.random.normal(keys[0], (t, d), bf16), tok)
  router = jax.random.normal(keys[1], (d, e), bf16) * 0.02
  idx, w, _ = jax.jit(lambda x, r: rm.route(x, r, top_k=k))(x, router)
  weights = [jax.device_put((jax.random.normal(kk, s, jnp.float32) / np.sqrt(s[1])).astype(bf16), exp)
             for kk, s in zip(keys[2:], ((e, d, f), (e, d, f), (e, f, d)))]
  if variant == TRANSFER:
    step, args = _transfer_step(jax, jnp, rm, mesh, weights), tuple(weights)
  else:
    dispatcher, options = variant_options(variant)

    def loss(x, w, wg, wu, wd):
      y = rm.moe_ffn(x, idx, w, wg, wu, wd, mesh=mesh, dispatcher=dispatcher, **options)
      return jnp.sum(y.astype(jnp.float32) ** 2)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))
    args = (x, w, *weights)
  row = dict(variant=variant, shape=shape, tokens_per_gpu=tokens_per_gpu, gpus=len(devices),
             device=devices[0].device_kind)
  try:
    compiled = step.lower(*args).compile()
    row["temp_bytes"] = int(compiled.memory_analysis().temp_size_in_bytes)
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(3):
      start = time.perf_counter()
      for _ in range(iters):
        out = compiled(*args)
      jax.block_until_ready(out)
      times.append((time.perf_counter() - start) / iters)
  except Exception as err:  # noqa: BLE001  (out of memory is a result here)
    row["error"] = "out of memory" if "RESOURCE_EXHAUSTED" in str(err) else f"{type(err).__name__}: {err}"[:300]
    return row
  row["latency_ms"] = sorted(times)[1] * 1e3
  stats = [dev.memory_stats() or {} for dev in devices]
  row["peak_bytes"] = max((s.get("peak_bytes_in_use", 0) for s in stats), default=0)
  useful = 0 if variant == TRANSFER else expert_flops(tokens_per_gpu, d, f, k)
  row["useful_tflops_per_gpu"] = useful / (row["latency_ms"] / 1e3) / 1e12
  if profile_dir:
    row["kernels"] = _profile(jax, compiled, args, os.path.join(profile_dir, variant.replace("/", "_")))
  return row


def _profile(jax, compiled, args, trace_dir):
  from benchmarks.trace_summary import find_trace, kernel_times  # noqa: PLC0415
  with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
    for _ in range(PROFILE_STEPS):
      out = compiled(*args)
    jax.block_until_ready(out)
  platform_device = "GPU:0" if jax.default_backend() == "gpu" else "CPU"
  return kernel_times(find_trace(trace_dir), PROFILE_STEPS, platform_device)


def run_isolated(variant, shape, tokens, iters, profile_dir=None):
  cmd = [sys.executable, "-m", "benchmarks.moe_layer", "--one", variant, "--shape", shape, "--tokens", str(tokens),
         "--iters", str(iters)] + (["--profile", profile_dir] if profile_dir else [])
  proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=900)
  for line in reversed(proc.stdout.splitlines()):
    if line.startswith("{"):
      return json.loads(line)
  return dict(variant=variant, shape=shape, tokens_per_gpu=tokens, error=(proc.stderr or proc.stdout)[-300:])


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
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True, cwd=REPO)
    temps = json.loads(out.stdout.strip().splitlines()[-1])
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


def render(rows, scaling):
  lines = ["| shape | T/GPU | variant | ms | peak GiB | temp GiB | useful TFLOP/s/GPU | vs dropless | vs cf1 | "
           "GEMM ms | exposed comm ms |", "|---|---|---|---|---|---|---|---|---|---|---|"]
  by = {(r["shape"], r["tokens_per_gpu"], r["variant"]): r for r in rows}
  for r in rows:
    if "error" in r:
      lines.append(f"| {r['shape']} | {r['tokens_per_gpu']} | {r['variant']} | {r['error'][:40]} | | | | | | | |")
      continue
    ratios = []
    for base in (() if r["variant"].startswith(("compute_floor", TRANSFER)) else ("a2a_dropless", "a2a_cf1")):
      b = by.get((r["shape"], r["tokens_per_gpu"], base))
      ratios.append(f"{b['latency_ms'] / r['latency_ms']:.2f}×" if b and "latency_ms" in b else "—")
    ratios = ratios or ["—", "—"]
    lines.append(f"| {r['shape']} | {r['tokens_per_gpu']} | {r['variant']} | {r['latency_ms']:.1f} | "
                 f"{r['peak_bytes'] / 2**30:.2f} | {r['temp_bytes'] / 2**30:.2f} | "
                 f"{r['useful_tflops_per_gpu']:.0f} | {ratios[0]} | {ratios[1]} | {_profiled(r)} |")
  if scaling:
    lines += ["", "| EP | E | T/dev | ring MiB | dropless MiB | cf1 MiB | dropless/ring | cf1/ring |",
              "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {s['ep']} | {s['num_experts']} | {s['tokens_per_device']} | {s['ring_expert'] / 2**20:.1f} | "
              f"{s['a2a_dropless'] / 2**20:.1f} | {s['a2a_cf1'] / 2**20:.1f} | {s['ratio_dropless']:.2f} | "
              f"{s['ratio_cf1']:.2f} |" for s in scaling]
  return "\n".join(lines)


def summary(rows, scaling, shape="qwen3_30b", tokens=65536):
  by = {r["variant"]: r for r in rows if r["shape"] == shape and r["tokens_per_gpu"] == tokens and "error" not in r}
  ring, dropless, cf1 = by.get("ring_expert"), by.get("a2a_dropless"), by.get("a2a_cf1")
  if not ring:
    return None
  ratio = lambda b, key: f"{b[key] / ring[key]:.2f}" if b and ring[key] else "nan"  # noqa: E731
  floor, transfer = by.get("compute_floor"), by.get(TRANSFER)
  # ring time / max(its compute alone, its transfers alone): 1.0 is perfect overlap.
  hop_overlap = (f"{ring['latency_ms'] / max(floor['latency_ms'], transfer['latency_ms']):.2f}"
                 if floor and transfer else "nan")
  ep = {s["ep"]: f"{s['ratio_cf1']:.2f}" for s in scaling}
  return (f"summary: moe_layer gpus={ring['gpus']} shape={shape} tokens={tokens} "
          f"speedup_vs_dropless={ratio(dropless, 'latency_ms')} speedup_vs_cf1={ratio(cf1, 'latency_ms')} "
          f"peak_mem_ratio_dropless={ratio(dropless, 'peak_bytes')} peak_mem_ratio_cf1={ratio(cf1, 'peak_bytes')} "
          f"useful_tflops={ring['useful_tflops_per_gpu']:.1f} hop_overlap={hop_overlap} "
          f"ep8_mem_ratio_cf1={ep.get(8, 'nan')} ep64_mem_ratio_cf1={ep.get(64, 'nan')}")


def plot(path):
  """Latency and peak memory of the Qwen3-30B layer against tokens per GPU (bars per variant when the file has one
  token count), and compile-only memory against EP."""
  import matplotlib  # noqa: PLC0415
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415
  data = json.load(open(path))
  rows = [r for r in data["rows"] if "error" not in r and r["shape"] == "qwen3_30b" and r["variant"] != TRANSFER]
  fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
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
      axes[i].plot(*zip(*pts), "o-", label=variant, color=colors[variant])
    axes[i].set(xlabel="tokens per GPU", ylabel=label, title=f"Qwen3-30B MoE layer: {what}")
    axes[i].legend()
  scaling = data.get("ep_scaling", [])
  for key in ("ring_expert", "a2a_dropless", "a2a_cf1"):
    axes[2].plot([s["ep"] for s in scaling], [s[key] / 2**20 for s in scaling], "o-", label=key)
  axes[2].set(xlabel="EP (emulated CPU devices)", ylabel="compiled temporaries MiB", xscale="log", yscale="log",
              title="memory vs EP (fixed tokens/device)")
  axes[2].set_xticks([s["ep"] for s in scaling], [str(s["ep"]) for s in scaling], minor=False)
  axes[2].minorticks_off()
  axes[2].legend()
  out = os.path.splitext(path)[0] + ".png"
  fig.tight_layout()
  fig.savefig(out, dpi=110)
  print(out)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--one", help=argparse.SUPPRESS)
  parser.add_argument("--shape", default="qwen3_30b", choices=sorted(SHAPES))
  parser.add_argument("--tokens", default="16384,32768,65536")
  parser.add_argument("--variants", default=",".join([*VARIANTS, TRANSFER]))
  parser.add_argument("--iters", type=int, default=5)
  parser.add_argument("--ep-scaling", action="store_true")
  parser.add_argument("--skip-layers", action="store_true", help="only --ep-scaling")
  parser.add_argument("--plot")
  parser.add_argument("--profile", metavar="DIR", help="also trace each variant under DIR and report kernel time")
  parser.add_argument("--out", default=os.path.join(RESULTS, "moe_layer.json"))
  args = parser.parse_args(argv)
  if args.one:
    print(json.dumps(run_one(args.one, args.shape, int(args.tokens), args.iters, args.profile)), flush=True)
    return
  if args.plot:
    plot(args.plot)
    return
  import jax  # noqa: PLC0415
  meta = dict(command="python -m benchmarks.moe_layer " + " ".join(sys.argv[1:] if argv is None else argv),
              python=platform.python_version(), jax=jax.__version__, xla_flags=os.environ.get("XLA_FLAGS", ""))
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  rows, scaling = [], []

  def save():  # after every row, so a run stopped at its time limit keeps what it measured
    with open(args.out, "w") as fh:
      json.dump(dict(meta=meta, rows=rows, ep_scaling=scaling), fh, indent=1)

  if not args.skip_layers:
    for tokens in map(int, args.tokens.split(",")):
      for variant in args.variants.split(","):
        rows.append(run_isolated(variant, args.shape, tokens, args.iters, args.profile))
        print(rows[-1], flush=True)
        save()
  if args.ep_scaling:
    scaling = ep_scaling()
  save()
  table = render(rows, scaling)
  line = summary(rows, scaling, args.shape, max(map(int, args.tokens.split(","))))
  text = table + ("\n" + line if line else "")
  with open(os.path.splitext(args.out)[0] + ".txt", "w") as fh:
    fh.write(text + "\n")
  print(text)


if __name__ == "__main__":
  main()
