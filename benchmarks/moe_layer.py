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
"""

import argparse
import contextlib
import functools
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "benchmarks", "results")
MODEL_OF_SHAPE = {"qwen3_30b": "qwen3-30b-a3b"}  # other shapes are named as their configs/models/ file
GRID = "grid"  # --shape grid: every grid-* model config, the paper's scaling grid (Table 3)
SUMMARY_SHAPE, SUMMARY_TOKENS = "qwen3_30b", 65536
MEM_FRACTION = "0.95"  # of each GPU's memory a variant process may allocate, unless XLA_PYTHON_CLIENT_MEM_FRACTION says


def layer_shape(name):
  """(D, F, E, K) of one MoE layer of a model config (`qwen3_30b`, `grid-e64-k8-f768`, `tiny`, …; `NAME*L`: L
  such layers)."""
  from models.qwen3 import load_config  # noqa: PLC0415
  name = name.partition("*")[0]
  c = load_config(MODEL_OF_SHAPE.get(name, name))
  return c.hidden_size, c.moe_intermediate_size, c.num_experts, c.num_experts_per_tok


def stack_depth(name):
  """L of a shape `NAME*L`: L MoE layers in sequence, each with its own experts and the residual between them
  (so one layer's weight-gradient send can overlap the backward of the layer below it); 1 for `NAME`."""
  depth = name.partition("*")[2]
  if depth and not (depth.isdigit() and int(depth) >= 1):
    raise ValueError(f"shape {name!r}: the layer count after '*' must be a positive integer")
  return int(depth or 1)


def shape_names(arg):
  """The shapes of --shape: a comma list, where `grid` stands for every grid-* model config."""
  from models.config import CONFIG_DIR  # noqa: PLC0415
  grid = sorted(p.stem for p in (CONFIG_DIR / "models").glob("grid-*.yaml"))
  names = [n for part in arg.split(",") for n in (grid if part == GRID else [part])]
  for name in names:
    layer_shape(name), stack_depth(name)  # an unknown name fails here, listing the known ones
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


def _transfer_step(jax, jnp, rm, mesh, layers):
  """A jitted step that moves exactly what ring_expert moves by default (forward `ring_pass` of the fused weights,
  backward `ring_relay` of weights and their gradients, reversed where the ring reverses it), with only a trivial
  add per hop. Every array of a payload and of an accumulator is read at the end and a hop's partial is a scaled
  copy, so XLA can drop no send: reading only w_down, an earlier version moved a third of the bytes (its compiled
  HLO had w_down's sends alone)."""
  from relaymoe_jax.grouped_matmul import fuse_gate_up  # noqa: PLC0415
  from relaymoe_jax.ring import ring_pass, ring_relay  # noqa: PLC0415
  n = mesh.shape[rm.EXPERT]
  reverse = rm.RingExpert().reverses_backward(n)
  corner = lambda arrays: sum(a[0, 0, 0].astype(jnp.float32) for a in arrays)  # noqa: E731
  touch = lambda state, _, payload: state + corner(payload)  # noqa: E731
  partial = lambda state, part, payload: (touch(state, part, payload),  # noqa: E731
                                          tuple(0.5 * a.astype(jnp.float32) for a in payload))

  def per_device(*weights):
    state = jnp.zeros((), jnp.float32)
    for layer in range(layers):
      w_gate, w_up, w_down = weights[3 * layer:3 * layer + 3]
      own = (fuse_gate_up(w_gate, w_up), w_down)
      state, last = ring_pass(touch, state, own, axis=rm.EXPERT, n=n)
      state, acc = ring_relay(partial, state, last if reverse else own, axis=rm.EXPERT, n=n,
                              to_relay=lambda a: tuple(x.astype(w_down.dtype) for x in a),  # noqa: B023
                              home=own if reverse else None)
      state = state + corner(acc)
    return state[None]

  spec = jax.sharding.PartitionSpec(rm.EXPERT)
  return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(spec,) * 3 * layers, out_specs=spec,
                               check_vma=False))


def expert_flops(tokens, d, f, k):
  """Useful fwd+bwd FLOPs of the experts: 3 × (gate+up 2·D·2F + down 2·F·D) per token–expert pair."""
  return 3 * tokens * k * (2 * d * 2 * f + 2 * f * d)


PROFILE_STEPS = 2
MEASURE_TIMEOUT_S = 300  # per variant, from "go" to its row (the slowest measured so far took ~20 s)


def _keep_local(x, axis_name, perm):  # noqa: ARG001  (ppermute's signature)
  return x


def _inputs(jax, jnp, np, rm, mesh, shape, tokens_per_gpu):
  """The same tokens, routing and expert weights for every variant (key 0), sharded over the expert axis."""
  from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: PLC0415
  d, f, e, k = layer_shape(shape)
  t = tokens_per_gpu * mesh.size
  keys = jax.random.split(jax.random.key(0), 2 + 3 * stack_depth(shape))
  sharded = NamedSharding(mesh, P(rm.EXPERT))
  bf16 = jnp.bfloat16
  # Each array made in place, sharded: a whole array made on the first GPU and then split would stay in that
  # process's allocator pool (it does not give memory back), on one GPU only.
  on_mesh = functools.partial(jax.jit, out_shardings=sharded)
  x = on_mesh(lambda: jax.random.normal(keys[0], (t, d), bf16))()
  router = jax.random.normal(keys[1], (d, e), bf16) * 0.02
  idx, w, _ = jax.jit(lambda x, r: rm.route(x, r, top_k=k), out_shardings=(sharded, sharded, None))(x, router)
  weights = [on_mesh(lambda kk=kk, s=s: (jax.random.normal(kk, s, jnp.float32) / np.sqrt(s[1])).astype(bf16))()
             for kk, s in zip(keys[2:], ((e, d, f), (e, d, f), (e, f, d)) * stack_depth(shape))]
  return x, idx, w, weights


def _step(jax, jnp, rm, mesh, variant, layers):
  """The jitted fwd+bwd step of one variant, taking (x, router weights, (w_gate, w_up, w_down) per layer, expert
  indices); the layers share the routing and chain through the residual, h ← h + y."""
  dispatcher, options = variant_options(variant)

  def loss(x, w, *weights_and_idx):
    *weights, idx = weights_and_idx
    h = x
    for layer in range(layers):
      y = rm.moe_ffn(h, idx, w, *weights[3 * layer:3 * layer + 3], mesh=mesh, dispatcher=dispatcher, **options)
      h = h + y
    return jnp.sum(y.astype(jnp.float32) ** 2)

  return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(2 + 3 * layers))))


def compiler_options(xla_options=()):
  """The library's `rm.COMPILER_OPTIONS` with `KEY=VALUE` overrides (true/false and integers parsed)."""
  import relaymoe_jax as rm  # noqa: PLC0415

  def parse(value):
    return {"true": True, "false": False}.get(value.lower(), int(value) if value.lstrip("-").isdigit() else value)

  overrides = {}
  for option in xla_options:
    key, sep, value = option.partition("=")
    if not sep:
      raise ValueError(f"--xla-option {option!r}: expected KEY=VALUE")
    overrides[key] = parse(value)
  return dict(rm.COMPILER_OPTIONS, **overrides)


def compile_variant(variant, shape, tokens_per_gpu, xla_options=(), gpus=None):
  """(compiled fwd+bwd step, a function making its arguments afresh, the devices) of one variant, compiled with
  `compiler_options(xla_options)`, on the first `gpus` devices (default all)."""
  import unittest.mock  # noqa: PLC0415

  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  import relaymoe_jax as rm  # noqa: PLC0415

  devices = jax.devices()[:1] if variant.startswith("compute_floor") else jax.devices()[:gpus]
  mesh = jax.sharding.Mesh(np.array(devices), (rm.EXPERT,))
  layers = stack_depth(shape)
  if variant == TRANSFER:
    step, pick = _transfer_step(jax, jnp, rm, mesh, layers), lambda x, idx, w, weights: tuple(weights)
  else:
    step, pick = _step(jax, jnp, rm, mesh, variant, layers), lambda x, idx, w, weights: (x, w, *weights, idx)
  make_args = lambda: pick(*_inputs(jax, jnp, np, rm, mesh, shape, tokens_per_gpu))  # noqa: E731
  no_sends = unittest.mock.patch("jax.lax.ppermute", _keep_local) if variant.startswith("ring_nocomm") else \
      contextlib.nullcontext()
  # Lowered from shapes alone, so a process waiting for its turn to measure holds no device memory. `_inputs`
  # splits every input over the expert axis on its first dimension (eval_shape does not keep shardings).
  sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(rm.EXPERT))
  abstract_args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharded) for a in jax.eval_shape(make_args)]
  with no_sends:
    return step.lower(*abstract_args).compile(compiler_options(xla_options)), make_args, devices


def run_one(variant, shape, tokens_per_gpu, iters, profile_dir=None, compiled_hook=None, xla_options=()):
  """Measures one variant in this process; returns a dict (or the failure). `compiled_hook(row)` runs between
  compiling and measuring, with no input left on the device. With `profile_dir`, then traces PROFILE_STEPS more
  steps there and adds the first device's kernel time by kind (`benchmarks.trace_summary`)."""
  import jax  # noqa: PLC0415

  row = dict(variant=variant, shape=shape, tokens_per_gpu=tokens_per_gpu)
  try:
    start = time.perf_counter()
    compiled, make_args, devices = compile_variant(variant, shape, tokens_per_gpu, xla_options)
    row.update(gpus=len(devices), device=devices[0].device_kind, compile_s=round(time.perf_counter() - start, 1),
               temp_bytes=int(compiled.memory_analysis().temp_size_in_bytes))
    if does_not_fit(compiled, devices, row):
      return row
    if compiled_hook:
      compiled_hook(row)
    args = make_args()
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
  d, f, _, k = layer_shape(shape)
  useful = 0 if variant in (TRANSFER, "ring_nocomm") else stack_depth(shape) * expert_flops(tokens_per_gpu, d, f, k)
  row["useful_tflops_per_gpu"] = useful / (row["latency_ms"] / 1e3) / 1e12
  if profile_dir:
    row["kernels"] = _profile(jax, compiled, args, os.path.join(profile_dir, variant.replace("/", "_")))
  return row


def does_not_fit(compiled, devices, row):
  """Whether the compiled step needs more than a device's allocator can give (then `row` says so, with both
  numbers): such a step is not run, because one GPU failing its allocation leaves the other GPU's half of the
  step waiting in a send that never completes, and the process hangs."""
  import relaymoe_jax as rm  # noqa: PLC0415
  limit = min((dev.memory_stats() or {}).get("bytes_limit", 0) for dev in devices)
  needed = rm.compiled_bytes(compiled)
  if not limit or needed <= limit:
    return False
  row.update(error="out of memory", needed_bytes=needed, limit_bytes=int(limit))
  return True


def _profile(jax, compiled, args, trace_dir):
  from benchmarks.trace_summary import find_trace, kernel_times  # noqa: PLC0415
  with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
    for _ in range(PROFILE_STEPS):
      out = compiled(*args)
    jax.block_until_ready(out)
  platform_device = "GPU:0" if jax.default_backend() == "gpu" else "CPU"
  return kernel_times(find_trace(trace_dir), PROFILE_STEPS, platform_device)


class _Child:
  """One variant in its own process (`--one`): it reports when compiled, then measures when told to."""

  def __init__(self, variant, shape, tokens, iters, profile_dir, xla_options):
    self.job = dict(variant=variant, shape=shape, tokens_per_gpu=tokens)
    cmd = [sys.executable, "-m", "benchmarks.moe_layer", "--one", variant, "--shape", shape, "--tokens", str(tokens),
           "--iters", str(iters)] + (["--profile", profile_dir] if profile_dir else []) + \
        [f"--xla-option={option}" for option in xla_options]
    # Without preallocation each process takes only what it uses, so the waiting ones leave the GPU to the one
    # measuring (peak_bytes_in_use counts the allocator's use either way); that one may take MEM_FRACTION of the
    # GPU (JAX's default, 0.75, would put the out-of-memory points a quarter of the GPU early).
    env = {"XLA_PYTHON_CLIENT_MEM_FRACTION": MEM_FRACTION, **os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    self.stderr = tempfile.TemporaryFile(mode="w+")
    self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True,
                                 cwd=REPO, env=env)
    self.result = None

  def _message(self):
    for line in self.proc.stdout:
      if line.startswith("{"):
        return json.loads(line)
    self.proc.wait()
    self.stderr.seek(0)
    return dict(self.job, error=self.stderr.read()[-300:] or f"exit status {self.proc.returncode}")

  def wait_compiled(self):
    message = self._message()
    if "variant" in message:  # failed before measuring
      self.result = message

  def measure(self, timeout_s=MEASURE_TIMEOUT_S):
    """The measured row; a process with no result after `timeout_s` is killed and its row says so, so one hung
    variant does not cost the rest of a device call."""
    if self.result is None:
      self.proc.stdin.write("go\n")
      self.proc.stdin.flush()
      timed_out = threading.Event()

      def kill():
        timed_out.set()
        self.proc.kill()

      watchdog = threading.Timer(timeout_s, kill)
      watchdog.start()
      try:
        self.result = self._message()
      finally:
        watchdog.cancel()
      if timed_out.is_set():
        self.result = dict(self.job, error=f"no result within {timeout_s} s: killed")
    self.close()
    return self.result

  def close(self, wait_s=30):
    """Waits for the process to exit, killing it after `wait_s`: a step that ran out of memory on one GPU can leave
    the other GPU's send waiting forever, and then the process never exits (two stalled device calls did this)."""
    try:
      self.proc.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
      self.proc.kill()
      self.proc.wait()


def run_isolated(jobs, iters, profile_dir=None, parallel=1, xla_options=()):
  """Yields a row per (shape, variant, tokens): `parallel` processes compile together, then measure one after
  another."""
  for start in range(0, len(jobs), parallel):
    batch = [_Child(variant, shape, tokens, iters, profile_dir, xla_options) for shape, variant, tokens in
             jobs[start:start + parallel]]
    for child in batch:
      child.wait_compiled()
    for child in batch:
      yield child.measure()


def _wait_for_turn(row):
  print(json.dumps(dict(compiled=True, compile_s=row["compile_s"])), flush=True)
  sys.stdin.readline()


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
  lines = ["| shape | T/GPU | variant | ms | peak GiB | temp GiB | useful TFLOP/s/GPU | vs dropless | vs cf1 | "
           "overlap (compute:transfer) | GEMM ms | exposed comm ms |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
  by = {(r["shape"], r["tokens_per_gpu"], r["variant"]): r for r in rows}
  for r in rows:
    if "error" in r:
      lines.append(f"| {r['shape']} | {r['tokens_per_gpu']} | {r['variant']} | {r['error'][:40]} | | | | | | | | |")
      continue
    ratios = []
    for base in (() if r["variant"].startswith(("compute_floor", "ring_nocomm", TRANSFER))
                 else ("a2a_dropless", "a2a_cf1")):
      b = by.get((r["shape"], r["tokens_per_gpu"], base))
      ratios.append(f"{b['latency_ms'] / r['latency_ms']:.2f}×" if b and "latency_ms" in b else "—")
    ratios = ratios or ["—", "—"]
    ov = overlap(rows, r) if r["variant"] in RING_SCHEDULES else None
    ov = f"{ov[0]:.2f} ({ov[1]:.1f}:1)" if ov else "—"
    lines.append(f"| {r['shape']} | {r['tokens_per_gpu']} | {r['variant']} | {r['latency_ms']:.1f} | "
                 f"{r['peak_bytes'] / 2**30:.2f} | {r['temp_bytes'] / 2**30:.2f} | "
                 f"{r['useful_tflops_per_gpu']:.0f} | {ratios[0]} | {ratios[1]} | {ov} | {_profiled(r)} |")
  profiled = [r for r in rows if r.get("kernels")]
  if profiled:
    kinds = sorted({k for r in profiled for k in r["kernels"]["by_kind"]}, key=lambda k: (k != "grouped matmul", k))
    lines += ["", "Kernel time per step on the first GPU, ms, by kind (`benchmarks.trace_summary`):", "",
              "| shape | T/GPU | variant | " + " | ".join(kinds) + " | all kernels | all but grouped matmul |",
              "|---|---|---|" + "---|" * (len(kinds) + 2)]
    for r in profiled:
      k = r["kernels"]
      lines.append(f"| {r['shape']} | {r['tokens_per_gpu']} | {r['variant']} | "
                   + " | ".join(f"{k['by_kind'].get(kind, 0.0):.1f}" for kind in kinds)
                   + f" | {k['busy_ms']:.1f} | {k['busy_ms'] - k['by_kind'].get('grouped matmul', 0.0):.1f} |")
  if scaling:
    lines += ["", "| EP | E | T/dev | ring MiB | dropless MiB | cf1 MiB | dropless/ring | cf1/ring |",
              "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {s['ep']} | {s['num_experts']} | {s['tokens_per_device']} | {s['ring_expert'] / 2**20:.1f} | "
              f"{s['a2a_dropless'] / 2**20:.1f} | {s['a2a_cf1'] / 2**20:.1f} | {s['ratio_dropless']:.2f} | "
              f"{s['ratio_cf1']:.2f} |" for s in scaling]
  return "\n".join(lines)


def summary(rows, scaling, shape=SUMMARY_SHAPE, tokens=SUMMARY_TOKENS):
  by = {r["variant"]: r for r in rows if r["shape"] == shape and r["tokens_per_gpu"] == tokens and "error" not in r}
  ring, dropless, cf1 = by.get("ring_expert"), by.get("a2a_dropless"), by.get("a2a_cf1")
  if not ring:
    return None
  floor = lambda v: f"{by[v]['useful_tflops_per_gpu']:.1f}" if v in by else "nan"  # noqa: E731
  ratio = lambda b, key: f"{b[key] / ring[key]:.2f}" if b and ring[key] else "nan"  # noqa: E731
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
  import matplotlib  # noqa: PLC0415
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415
  import matplotlib.ticker  # noqa: PLC0415
  data = json.load(open(path))
  ours = [r for r in data["rows"] if r["shape"] == SUMMARY_SHAPE and r["variant"] != TRANSFER]
  rows = [r for r in ours if "error" not in r]
  oom = {}
  for r in ours:
    if r.get("error") == "out of memory":
      oom.setdefault(r["variant"], []).append(str(r["tokens_per_gpu"]))
  fig, axes = plt.subplots(1, 3, figsize=(16, 5))
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
    axes[i].yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1, 2, 5)))
    axes[i].yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
  scaling = (data.get("ep_scaling") or {}).get("rows", [])
  for key in ("ring_expert", "a2a_dropless", "a2a_cf1"):
    axes[2].plot([s["ep"] for s in scaling], [s[key] / 2**20 for s in scaling], "o-", label=key)
  axes[2].set(xlabel="EP (emulated CPU devices)", ylabel="compiled temporaries MiB", xscale="log", yscale="log",
              title="memory vs EP (fixed tokens/device)")
  axes[2].set_xticks([s["ep"] for s in scaling], [str(s["ep"]) for s in scaling], minor=False)
  axes[2].minorticks_off()
  axes[2].legend()
  out = os.path.splitext(path)[0] + ".png"
  fig.tight_layout()
  if len(tokens) > 1:  # one legend for the two panels, below them
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=4, fontsize=8)
    fig.subplots_adjust(bottom=0.22)
  fig.savefig(out, dpi=110)
  print(out)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--one", help=argparse.SUPPRESS)
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
  parser.add_argument("--out", default=os.path.join(RESULTS, "moe_layer.json"))
  args = parser.parse_args(argv)
  options = compiler_options(args.xla_option)  # a bad KEY=VALUE fails here, before any process starts
  if args.one:
    print(json.dumps(run_one(args.one, args.shape, int(args.tokens), args.iters, args.profile, _wait_for_turn,
                             args.xla_option)), flush=True)
    return
  if args.plot:
    plot(args.plot)
    return
  if args.merge:
    merge(args.merge, args.out)
    return
  meta = dict(command="python -m benchmarks.moe_layer " + " ".join(sys.argv[1:] if argv is None else argv),
              compiler_options=options, **machine())
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  rows, scaling = [], []

  def save():  # after every row, so a run stopped at its time limit keeps what it measured
    with open(args.out, "w") as fh:
      json.dump(dict(meta=meta, rows=rows, ep_scaling=scaling), fh, indent=1)

  if not args.skip_layers:
    tokens = list(map(int, args.tokens.split(",")))
    # the transfers do not depend on the token count: measured once per shape, at the first
    jobs = [(s, v, t) for s in shape_names(args.shape) for t in tokens for v in args.variants.split(",")
            if v != TRANSFER or t == tokens[0]]
    for row in run_isolated(jobs, args.iters, args.profile, args.parallel, args.xla_option):
      rows.append(row)
      print(row, flush=True)
      save()
  if args.ep_scaling:
    scaling = dict(meta, measure="compile-only temp_size_in_bytes", rows=ep_scaling())
  save()
  print(write_table(dict(meta=meta, rows=rows, ep_scaling=scaling), args.out))


def machine():
  """Python, JAX, XLA flags and the devices (with the NVIDIA driver when there is one) of this run."""
  import jax  # noqa: PLC0415
  devices = jax.devices()
  what = f"{len(devices)}x {devices[0].device_kind}" if jax.default_backend() == "gpu" else \
      f"{platform.machine()} CPU, emulated devices"
  try:
    driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                            capture_output=True, text=True, check=True).stdout.split()[0]
    what += f", driver {driver}"
  except (OSError, subprocess.CalledProcessError, IndexError):
    pass
  gpu = {"mem_fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", MEM_FRACTION)} \
      if jax.default_backend() == "gpu" else {}
  return dict(python=platform.python_version(), jax=jax.__version__, xla_flags=os.environ.get("XLA_FLAGS", ""),
              machine=what, **gpu)


def merge(paths, out):
  """One results file from several runs (e.g. one per device call): rows by shape and token count, a later run's
  row replacing an earlier one of the same shape, variant and token count (a `transfer` row, which does not depend
  on the token count, any earlier one of its shape); the last EP-scaling found."""
  rows, runs, scaling = {}, [], {}
  for path in paths:
    data = json.load(open(path))
    runs.extend(data["meta"].get("runs", [data["meta"]]))  # a merged file brings its runs
    rows.update({(r["shape"], r["variant"], None if r["variant"] == TRANSFER else r["tokens_per_gpu"]): r
                 for r in data["rows"]})
    scaling = data.get("ep_scaling") or scaling
  ordered = sorted(rows.values(), key=lambda r: (r["shape"] != SUMMARY_SHAPE, r["shape"], r["tokens_per_gpu"]))
  merged = dict(meta=dict(runs=runs), rows=ordered, ep_scaling=scaling)
  with open(out, "w") as fh:
    json.dump(merged, fh, indent=1)
  print(write_table(merged, out))


def write_table(data, out):
  """The table (runs, then rows, then EP scaling) and the summary line, into the .txt next to `out`."""
  runs = data["meta"].get("runs", [data["meta"]])
  scaling = data.get("ep_scaling") or {}
  header = [f"# {m['command']}\n#   {m.get('machine', '?')}; JAX {m['jax']}, Python {m['python']}; "
            f"XLA_FLAGS={m.get('xla_flags') or '(default)'}; compiler options {m.get('compiler_options', '(none)')}"
            + (f"; GPU memory fraction {m['mem_fraction']}" if "mem_fraction" in m else "")
            + (f"; code: {m['code']}" if "code" in m else "")
            for m in runs + ([scaling] if scaling and scaling["command"] not in {r["command"] for r in runs} else [])]
  line = summary(data["rows"], scaling.get("rows", []))
  text = "\n".join(header + [render(data["rows"], scaling.get("rows", []))] + ([line] if line else []))
  with open(os.path.splitext(out)[0] + ".txt", "w") as fh:
    fh.write(text + "\n")
  return text


if __name__ == "__main__":
  main()
