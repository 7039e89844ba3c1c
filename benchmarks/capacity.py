"""The longest sequence that trains, per dispatcher: the expert ring against all-to-all (dropless, capacity 1.0).

    python -m benchmarks.capacity [--config ep8] [--layers 4] [--start-seq 65536] [--granule 4096]
                                  [--topology 1x1x8 --topology-layers 4,48] [--no-confirm]
    python -m benchmarks.capacity --merge A.json B.json --out C.json   # one table from several runs
    python -m benchmarks.capacity --loss-head-only --topology 1x1x1 --target-config benchmarks/gpu_specs/h200.txtpb
    python -m benchmarks.capacity --context-parallel --no-local --topology 1x1x8 --topology-layers 48 ...

Per dispatcher, `relaymoe-plan --maximize seq` (in parallel processes: compiling is CPU work) finds the longest
sequence at micro-batch 1 per GPU whose compiled train step fits the device, with that dispatcher's own most
frugal remat plan (`train.plan.planner`); nothing is allocated. Then, on GPUs, each limit is confirmed by a real training
step (`relaymoe-train`, one step, no checkpoint) and the first size above it is run with the fit check lifted to
show that it really does not fit. `--topology 1x1x8` repeats the search compile-only for a host of eight GPUs of
this machine's kind, or of `--target-config`'s on a machine without one (JAX's deviceless compilation, with the
CUDA plugin installed; nothing runs). A loss-head table compares the compiled temporaries of the plain loss (full
float32 logits) and the chunked one at 65536 tokens. `--context-parallel`: one sequence spread over the expert
axis (`runtime.context_parallel`), written to capacity_cp.json with its own summary line.

Writes JSON, a table whose last line is the summary, and a plot under benchmarks/results/.
"""

import argparse
import json
import os
import subprocess
import sys
import time

from benchmarks import harness

VARIANTS = ("ring", "a2a_dropless", "a2a_cf1")
# A confirming step that has not finished by then is reported so. It compiles afresh (no persistent cache), then
# steps: 537 s for the ring's 999424 tokens on one H200 (a 309 s step).
STEP_TIMEOUT_S = 900


def _env():
  # Several processes share the GPU while they compile: none may take its memory up front.
  return harness.child_env()


def start_search(config, layers, variants, work, start_seq, granule, overrides=(), topology=None, quiet=False,
                 target_config=None):
  """One `relaymoe-plan --maximize seq` process per variant, started at once; `collect` waits for them. `quiet`:
  no autotuning, so the processes leave the GPU's memory alone while real steps run beside them."""
  procs = {}
  env = _env()
  if quiet:
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_autotune_level=0").strip()
  for variant in variants:
    out = os.path.join(work, f"{topology or 'local'}_{layers}l_{variant}")
    cmd = [sys.executable, "-c", "from train.cli import plan_main; plan_main()", "--config", config,
           "--maximize", "seq", "--no-upgrade",
           "--variants", variant, "--granule", str(granule), "--out", out, f"model.num_hidden_layers={layers}",
           f"seq_len={start_seq}", "compilation_cache_dir=''", *overrides,
           *(["--topology", topology] if topology else []),
           *(["--target-config", target_config] if topology and target_config else [])]
    os.makedirs(out, exist_ok=True)
    log = open(os.path.join(out, "log.txt"), "w")
    procs[variant] = (subprocess.Popen(cmd, cwd=harness.REPO, env=env, stdout=log, stderr=subprocess.STDOUT), out, log)
  return procs


def collect(procs):
  """{variant: its plan.json entry, or an error with the end of its log}."""
  results = {}
  for variant, (proc, out, log) in procs.items():
    proc.wait()
    log.close()
    path = os.path.join(out, "plan.json")
    if proc.returncode or not os.path.exists(path):
      tail = open(os.path.join(out, "log.txt")).read()[-1500:]
      results[variant] = dict(error=f"relaymoe-plan exited {proc.returncode}: {tail}")
      continue
    with open(path) as fh:
      plan = json.load(fh)
    results[variant] = dict(plan["variants"][variant], devices=plan["devices"], device_kind=plan["device_kind"])
  return results


def train_command(config, layers, found, seq_len, work, lift_fit_check, overrides=()):
  """relaymoe-train for one step at seq_len with the variant's plan (the fit check lifted if asked)."""
  plan = found["plan"]
  ring = {**({"max_chunk_rows": plan["max_chunk_rows"]} if plan.get("max_chunk_rows") else {}),
          **({"keep_gate_up": True} if plan.get("keep_gate_up") else {})}
  options = json.dumps({**found.get("options", {}), **ring})
  remat = "[" + ",".join(plan["remat"]) + "]"
  out = os.path.join(work, f"train_{found['dispatcher']}_{options.count('capacity')}_{seq_len}")
  cmd = [sys.executable, "-m", "train.cli", "--config", config, "--steps", "1", "--out", out,
         f"model.num_hidden_layers={layers}", f"seq_len={seq_len}", f"batch_size={plan['batch_size']}",
         f"runtime.dispatcher={found['dispatcher']}", f"runtime.dispatcher_options={options}",
         f"runtime.remat={remat}",
         *([f"runtime.sequence_span_tokens={plan['sequence_span_tokens']}"]
           if plan.get("sequence_span_tokens") else []),
         "checkpoint_every=0", "log_every=1", "tensorboard=false", "compilation_cache_dir=''", *overrides,
         *(["device_memory_gib=100000"] if lift_fit_check else [])]
  return cmd


def train_once(config, layers, found, seq_len, work, lift_fit_check, overrides=()):
  """One training step; dict(ran, peak GiB or None, seconds, the out-of-memory or last output line)."""
  cmd = train_command(config, layers, found, seq_len, work, lift_fit_check, overrides)
  out = cmd[cmd.index("--out") + 1]
  start = time.perf_counter()
  # As a user's run: the allocator takes its share up front, one region, so a step's temporaries (one block) are not
  # refused for lack of a contiguous range while enough memory is free in regions grown earlier (init, loading).
  env = harness.child_env(XLA_PYTHON_CLIENT_PREALLOCATE="true")
  try:
    proc = subprocess.run(cmd, cwd=harness.REPO, env=env, capture_output=True, text=True, timeout=STEP_TIMEOUT_S)
  except subprocess.TimeoutExpired:
    return dict(ran=False, peak_gib=None, seconds=STEP_TIMEOUT_S, message=f"no result in {STEP_TIMEOUT_S} s")
  seconds = time.perf_counter() - start
  lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
  with open(out + ".log", "w") as fh:
    fh.write("\n".join(lines) + "\n")
  metrics = os.path.join(out, "metrics.jsonl")
  peak = None
  if proc.returncode == 0 and os.path.exists(metrics):
    with open(metrics) as fh:
      peak = json.loads(fh.readlines()[-1])["peak_memory_bytes"] / 2**30
  oom = [line for line in lines if "RESOURCE_EXHAUSTED" in line or "out of memory" in line.lower()]
  return dict(ran=proc.returncode == 0, peak_gib=peak, seconds=round(seconds, 1),
              message=(oom or lines or [""])[-1][:300])


def confirm(config, layers, results, work, overrides=()):
  """A real step at each variant's limit, and one at the first size found not to fit (fit check lifted). The
  steps are first compiled in parallel processes into one compilation cache, then run one at a time from it."""
  overrides = [*overrides, f"compilation_cache_dir={os.path.join(work, 'xla_cache')}"]
  runs = [(variant, found, seq, lift) for variant, found in results.items() if found.get("plan")
          for seq, lift in ((found["plan"]["seq_len"], False), (found.get("not_fitting"), True)) if seq]
  compiles = [subprocess.Popen(train_command(config, layers, found, seq, work, lift, overrides) + ["--compile-only"],
                               cwd=harness.REPO, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
              for _, found, seq, lift in runs]
  for proc in compiles:
    proc.wait()
  for variant, found, seq, lift in runs:
    found["above_limit" if lift else "at_limit"] = train_once(config, layers, found, seq, work, lift, overrides)
    print(f"  {variant} at {seq}: {found['above_limit' if lift else 'at_limit']}", flush=True)


def describe(config, loss_head=False, topology=None, target_config=None):
  """`benchmarks.capacity_worker` in a child: {"machine": …, "model": …} and, with `loss_head`, the loss-head table's
  row."""
  cmd = [sys.executable, "-m", "benchmarks.capacity_worker", "--config", config,
         *(["--loss-head"] if loss_head else []),
         *(["--topology", topology] if topology else []),
         *(["--target-config", target_config] if target_config else [])]
  return harness.json_child(cmd, _env())


def render(data):
  lines = [f"# {data['command']}", f"# {json.dumps(data['machine'])}", ""]
  if data["settings"]:
    lines += ["| setting | variant | longest seq | plan | step GiB (compiled) | budget GiB | first not fitting | "
              "real step at the limit | real step above it |", "|---|---|---|---|---|---|---|---|---|"]
  for setting in data["settings"]:
    for variant, r in setting["variants"].items():
      name = setting["name"]
      if "error" in r or not r.get("plan"):
        lines.append(f"| {name} | {variant} | — | {r.get('error', 'nothing fits')[:80]} | | | | | |")
        continue
      p = r["plan"]
      lines.append(f"| {name} | {variant} | {p['seq_len']} | {p['summary']} | {p['total_bytes'] / 2**30:.1f} | "
                   f"{p['budget_bytes'] / 2**30:.1f} | {r.get('not_fitting')} | {_step(r.get('at_limit'))} | "
                   f"{_step(r.get('above_limit'))} |")
  notes = [f"- {s['name']}: {s['note']}" for s in data["settings"] if s.get("note")]
  lines += [""] + notes if notes else []
  head = data.get("loss_head")
  if head:
    lines += ["", f"Loss head fwd+bwd at {head['tokens']} tokens (D {head['d_model']}, vocab {head['vocab']}"
              f"{', ' + head['device_kind'] if head.get('device_kind') else ''}), "
              f"compiled temporaries: plain {head['plain_temp_gib']:.1f} GiB (full float32 logits "
              f"{head['full_logits_gib']:.1f} GiB), chunked ({head['chunk_tokens']} tokens × "
              f"{head.get('vocab_tile', head['vocab'])} columns) "
              f"{head['chunked_temp_gib']:.2f} GiB per token"
              f"{_forward_grad(head)}{'; ' + head['how'] if head.get('how') else ''}."]
  if data["settings"]:
    lines.append(summary(data))
  return "\n".join(lines)


def _forward_grad(head):
  """The trainer's head (its gradient from the forward), where the run measured it."""
  gib = head.get("forward_grad_temp_gib")
  return "" if gib is None else f", {gib:.2f} GiB as the trainer's mean with its gradient from the forward"


def _step(r):
  if not r:
    return "—"
  return f"ran, peak {r['peak_gib']:.1f} GiB, {r['seconds']:.0f} s" if r["ran"] else f"failed: {r['message'][:90]}"


def summary(data):
  """The line people read: per variant, the longest sequence over the settings on real GPUs (not a topology):
  a limit counts where its real step, if one was run, trained, and the size above it where its step trained. The
  all-to-all (the baseline) also takes a longer limit from a compile-only search on as many GPUs: code newer than
  its real steps may fit more, and a baseline gets every chance; the ring takes real steps only.
  Under context parallelism: the deepest setting on the most GPUs, compile-only included."""
  if data.get("context_parallel"):
    return _context_parallel_summary(data)
  local = [s for s in data["settings"] if not s.get("topology")] or data["settings"][:1]
  alike = local + [s for s in data["settings"] if s.get("topology") and s.get("gpus") == local[0].get("gpus")]
  seq = {v: max([_longest(s["variants"].get(v, {})) for s in (local if v == "ring" else alike)] or [0])
         for v in VARIANTS}
  local = local[0]
  ratio = seq.get("ring", 0) / seq["a2a_dropless"] if seq.get("a2a_dropless") else float("nan")
  return (f"summary: capacity model={_model(data)} gpus={local['gpus']} ring_max_seq={seq.get('ring', 0)} "
          f"a2a_max_seq={seq.get('a2a_dropless', 0)} cf1_max_seq={seq.get('a2a_cf1', 0)} ratio={ratio:.2f}")


def _context_parallel_summary(data):
  setting = max(data["settings"], key=lambda s: (s.get("gpus") or 0, s["layers"]))
  seq = {v: _longest(setting["variants"].get(v, {})) for v in VARIANTS}
  ratio = seq["ring"] / seq["a2a_dropless"] if seq["a2a_dropless"] else float("nan")
  return (f"summary: capacity_cp model={_model(data)} gpus={setting['gpus']} layers={setting['layers']} "
          f"ring_max_seq={seq['ring']} a2a_max_seq={seq['a2a_dropless']} cf1_max_seq={seq['a2a_cf1']} "
          f"ratio={ratio:.2f}")


def _model(data):
  return data.get("model", "qwen3_30b")  # results written before the model was recorded are Qwen3-30B-A3B's


def _ran(step):
  return (step or {}).get("ran")


def _longest(r):
  limit = (r.get("plan") or {}).get("seq_len", 0) if _ran(r.get("at_limit") or {"ran": True}) else 0
  above = (r.get("not_fitting") or 0) if _ran(r.get("above_limit")) else 0
  return max(limit, above)


def plot(data, path):
  settings = data["settings"]
  if harness.Figure is None or not settings:  # no matplotlib, or a loss-head-only run
    return
  fig = harness.Figure(figsize=(8, 4))
  ax = fig.subplots()
  width = 0.8 / len(VARIANTS)
  for i, variant in enumerate(VARIANTS):
    values = [((s["variants"].get(variant) or {}).get("plan") or {}).get("seq_len", 0) / 1024 for s in settings]
    ax.bar([j + i * width for j in range(len(settings))], values, width, label=variant)
  ax.set_xticks([j + width for j in range(len(settings))], [s["name"] for s in settings], fontsize=8)
  ax.set(ylabel="longest sequence (K tokens), micro-batch 1 per GPU", title=f"{_model(data)}: what trains")
  ax.legend()
  fig.tight_layout()
  harness.save_figure(fig, path)


def write(data, out):
  harness.write_json(data, out)
  text = harness.write_table(render(data), out)
  plot(data, out)
  print(text)


def _merge_settings(earlier, later):
  return {**earlier, **later, "variants": {**earlier.get("variants", {}), **later["variants"]}}


def merge(paths, out):
  """Settings of several runs in one file (in a setting of the same name, a later run's variant and note replace an
  earlier one's: a confirming run adds its steps to the search it confirms)."""
  runs = [harness.load_json(p) for p in paths]
  settings = harness.merge_by_key([s for run in runs for s in run["settings"]], lambda s: s["name"], _merge_settings)
  ordered = sorted(settings, key=lambda s: bool(s.get("topology")))  # real GPUs first, then compile-only
  data = dict(runs[-1], command="python -m benchmarks.capacity --merge " + " ".join(paths), settings=ordered,
              merged_from=[r["command"] for r in runs])
  data["loss_head"] = next((r["loss_head"] for r in reversed(runs) if r.get("loss_head")), None)
  write(data, out)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="ep8")
  parser.add_argument("--layers", type=int, default=4, help="layers for the search on this machine's devices")
  parser.add_argument("--variants", default=",".join(VARIANTS))
  parser.add_argument("--start-seq", type=int, default=65536)
  parser.add_argument("--granule", type=int, default=4096)
  parser.add_argument("--topology", help="also search compile-only for this GPU host, e.g. 1x1x8")
  parser.add_argument("--topology-layers", default="4,48")
  parser.add_argument("--target-config", help="with --topology: a GpuTargetConfigProto text file, for compiling on a "
                      "machine without the GPU (default: this machine's GPU)")
  parser.add_argument("--no-local", action="store_true", help="skip the search on this machine's devices")
  parser.add_argument("--no-confirm", action="store_true", help="do not run real steps (CPU: never)")
  parser.add_argument("--confirm-from", help="also run the real steps for the limits of this earlier result's "
                      "setting --confirm-setting (its --variants only); searches started beside them do not autotune")
  parser.add_argument("--confirm-setting", help="the name of that setting")
  parser.add_argument("--ring-chunk-rows", type=int, help="the expert ring's chunk_rows (R) in every run")
  parser.add_argument("--no-loss-head", action="store_true")
  parser.add_argument("--loss-head-only", action="store_true", help="only the loss-head table (with --topology and no "
                      "GPU here: compiled for the topology's GPU)")
  parser.add_argument("--context-parallel", action="store_true", help="each sequence split over the expert axis "
                      "(default --out: capacity_cp.json)")
  parser.add_argument("--work", default="/tmp/relaymoe_capacity")
  parser.add_argument("--merge", nargs="+")
  parser.add_argument("--out")
  parser.add_argument("overrides", nargs="*", metavar="key=value", help="run-config overrides for every run")
  args = parser.parse_args(argv)
  args.out = args.out or os.path.join(harness.RESULTS,
                                      "capacity_cp.json" if args.context_parallel else "capacity.json")
  if args.merge:
    return merge(args.merge, args.out)
  variants = args.variants.split(",")
  # The machine (and, alone, the loss head) from a JAX child, which holds no GPU memory once it has answered.
  info = describe(args.config, args.loss_head_only, args.topology, args.target_config)
  data = dict(command=harness.command_line("capacity", argv), machine=info["machine"], settings=[],
              model=info["model"],
              context_parallel=args.context_parallel)
  if args.loss_head_only:
    data["loss_head"] = info["loss_head"]
    return write(data, args.out)
  searches = []  # (setting, processes): every search runs at once
  overrides = list(args.overrides)
  if args.ring_chunk_rows:  # the all-to-all variants keep only the backend of these options
    overrides.append(f"runtime.dispatcher_options={{chunk_rows: {args.ring_chunk_rows}}}")
  suffix = f", ring chunk_rows {args.ring_chunk_rows}" if args.ring_chunk_rows else ""
  if args.context_parallel:
    overrides.append("runtime.context_parallel=true")
    suffix += ", context parallel"
  if not args.no_local:
    local = dict(layers=args.layers, suffix=suffix)
    searches.append((local, start_search(args.config, args.layers, variants, args.work, args.start_seq,
                                         args.granule, overrides, quiet=bool(args.confirm_from))))
  for layers in ([int(n) for n in args.topology_layers.split(",")] if args.topology else []):
    setting = dict(name=f"{args.topology} compile-only {layers} layers{suffix}", layers=layers,
                   topology=args.topology)
    searches.append((setting, start_search(args.config, layers, variants, args.work, args.start_seq, args.granule,
                                           overrides, args.topology, quiet=bool(args.confirm_from),
                                           target_config=args.target_config)))
  if args.confirm_from:
    earlier = next(s for s in harness.load_json(args.confirm_from)["settings"] if s["name"] == args.confirm_setting)
    earlier.pop("note", None)  # it told of that run
    earlier["variants"] = {v: r for v, r in earlier["variants"].items() if v in variants}
    confirm(args.config, earlier["layers"], earlier["variants"], args.work, args.overrides)
    data["settings"].append(earlier)
  for setting, procs in searches:
    setting["variants"] = collect(procs)
    setting["gpus"] = next((r["devices"] for r in setting["variants"].values() if "devices" in r), None)
    if not setting.get("topology"):
      kind = next((r["device_kind"] for r in setting["variants"].values() if "device_kind" in r), "?")
      setting["name"] = f"{setting['gpus']}x{kind} {setting['layers']} layers{setting.pop('suffix')}"
      if data["machine"]["backend"] == "gpu" and not args.no_confirm:
        confirm(args.config, setting["layers"], setting["variants"], args.work, args.overrides)
    data["settings"].append(setting)
    write(data, args.out)
  if not args.no_loss_head:
    data["loss_head"] = describe(args.config, True, args.topology, args.target_config)["loss_head"]
  write(data, args.out)


if __name__ == "__main__":
  main()
