"""The gated delta rule (Gated DeltaNet's core) on one device: this project's kernels and XLA form, MaxText's
formulation and fla's Triton kernels, forward and forward + backward, in one run.

    python -m benchmarks.gated_deltanet [--shapes 16x4096,1x65536,1x262144] [--variants pallas,xla,maxtext,fla]
                                        [--key-heads 16] [--value-heads 32] [--head-dim 128] [--iters 5]
                                        [--out benchmarks/results/gated_deltanet.json] [--profile DIR]
                                        [--compile-only --target-config benchmarks/gpu_specs/h200.txtpb]

Inputs as the Qwen3.5-35B-A3B layer gives them: bf16 q, k [B, T, 16, 128] (L2-normalised in the rule) and v
[B, T, 32, 128], float32 log decays g ≤ 0 and write strengths β in (0, 1). Forward + backward is
`jax.value_and_grad` of Σ o ⊙ w over q, k, v, g and β (fla: `backward` of the same sum).
  pallas   `gated_delta_rule(state_kernel="pallas")`: forward and backward in this project's Pallas kernels (the
           chunks' inverses, the loop over chunks, the output; the backward's five), XLA's elementwise work around
           them, all matmuls on bfloat16 operands; rows over `SPAN_TOKENS` run in spans, as the rule's callers get;
  pallas_whole  the same, every row whole (`span_tokens=None`: its VJP keeps the state pass at any length);
  xla      `gated_delta_rule`: the chunked form in XLA, float32 at HIGHEST precision, the loop a `lax.scan`;
  xla_bf16chunks  the same with `chunk_dtype=bfloat16`: the chunks' own matmuls on bfloat16 operands;
  maxtext  MaxText's training formulation, written here from its description (`maxtext_gated_delta_rule`):
           float32 math at HIGHEST precision, chunk 64, `solve_triangular` for (I + A)⁻¹, u and w cast to bf16,
           a `lax.scan` over chunks, plain autodiff;
  fla      fla's `chunk_gated_delta_rule` (Triton) through torch, q and k repeated to the value heads; its
           backward where fla allows it on this Triton (it refuses Triton 3.4–3.7.0 on Hopper).
With `--profile DIR`, each JAX variant's forward and forward + backward are also traced under DIR and its row
gets their ten longest kernels per call (`benchmarks.trace_summary`): where the time goes.
With `--compile-only`, the JAX variants are compiled for one GPU and not run (on a machine without one, JAX's
deviceless compilation for `--target-config`'s GPU, with the CUDA plugin: Triton compiles the kernels too), and the
rows give each pass's compiled temporaries (`fwd_temp_gib`, `fwd_bwd_temp_gib`) instead of times, and the kernel
path's row each of its kernels' registers per thread and bytes spilled, from ptxas
(`benchmarks.harness.kernel_registers`).
A variant that cannot run here (fla not installed, no GPU for the kernels compiled, out of memory) is a row saying
why. Prints a table and writes JSON; the last line is the summary of the first shape.
"""

import argparse
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from benchmarks import harness
from benchmarks.cp_attention import seconds
from benchmarks.trace_summary import find_trace, kernel_times
from models.attention.gated_delta import SPAN_TOKENS, gated_delta_rule
from train.plan.search import topology_devices

VARIANTS = ("pallas", "pallas_whole", "xla", "xla_bf16chunks", "maxtext", "fla")


def inputs(batch, tokens, key_heads, value_heads, head_dim, seed=0):
  """(q, k, v, g, beta, w) as the model's layer makes them; w weighs the output for the backward."""
  keys = jax.random.split(jax.random.key(seed), 6)
  bf16 = lambda key, heads: jax.random.normal(key, (batch, tokens, heads, head_dim), jnp.bfloat16)
  g = -jax.nn.softplus(jax.random.normal(keys[3], (batch, tokens, value_heads))) * 0.5
  beta = jax.nn.sigmoid(jax.random.normal(keys[4], (batch, tokens, value_heads)))
  return (bf16(keys[0], key_heads), bf16(keys[1], key_heads), bf16(keys[2], value_heads), g, beta,
          bf16(keys[5], value_heads))


def maxtext_gated_delta_rule(q, k, v, g, beta, chunk_size=64, compute_dtype=jnp.bfloat16):
  """MaxText's `jax_chunk_gated_delta_rule` as its description reads (no documents, no initial state; u and w cast
  to `compute_dtype`): o [B, T, Hv, V] in v's dtype."""
  hp = functools.partial(jnp.einsum, precision=lax.Precision.HIGHEST)
  b, t, hv, _ = v.shape
  norm = lambda x: x * lax.rsqrt(jnp.sum(x * x, -1, keepdims=True) + 1e-6)
  repeat = lambda x: jnp.repeat(x, hv // x.shape[2], axis=2)
  q = repeat(norm(q.astype(jnp.float32))) * q.shape[-1] ** -0.5
  k = repeat(norm(k.astype(jnp.float32)))
  pad = -t % chunk_size
  chunks = lambda x: jnp.moveaxis(jnp.pad(x.astype(jnp.float32), [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
                                  .reshape(b, -1, chunk_size, *x.shape[2:]), 3, 2)  # [B, N, H, C, ...]
  q, k, vc = chunks(q), chunks(k), chunks(v)
  g, beta = chunks(g[..., None])[..., 0], chunks(beta[..., None])[..., 0]
  gamma = jnp.cumsum(g, -1)
  lower = jnp.tril(jnp.ones((chunk_size, chunk_size), bool), -1)
  causal = jnp.tril(jnp.ones((chunk_size, chunk_size), bool))
  diff = gamma[..., :, None] - gamma[..., None, :]
  s = hp("...rk,...sk->...rs", k * beta[..., None], k) * jnp.exp(jnp.where(lower, diff, -1e30))
  eye = jnp.eye(chunk_size, dtype=jnp.float32)
  a = jax.scipy.linalg.solve_triangular(eye + s, jnp.broadcast_to(eye, s.shape), lower=True, unit_diagonal=True)
  u = hp("...rs,...sv->...rv", a, vc * beta[..., None]).astype(compute_dtype)
  w = hp("...rs,...sk->...rk", a, k * (beta * jnp.exp(gamma))[..., None]).astype(compute_dtype)
  decay = jnp.exp(jnp.where(causal, diff, -1e30))
  qk = hp("...rk,...sk->...rs", q, k) * decay
  q_in, k_out = q * jnp.exp(gamma)[..., None], k * jnp.exp(gamma[..., -1:] - gamma)[..., None]

  def step(h, x):
    u, w, q_in, k_out, qk, end = x
    v_new = u.astype(jnp.float32) - hp("bhck,bhkv->bhcv", w.astype(jnp.float32), h)
    o = hp("bhck,bhkv->bhcv", q_in, h) + hp("bhrs,bhsv->bhrv", qk, v_new)
    return jnp.exp(end)[..., None, None] * h + hp("bhck,bhcv->bhkv", k_out, v_new), o

  xs = [jnp.moveaxis(x, 1, 0) for x in (u, w, q_in, k_out, qk, gamma[..., -1])]
  h0 = jnp.zeros((b, hv, k.shape[-1], v.shape[-1]), jnp.float32)
  _, o = lax.scan(step, h0, xs)  # [N, B, H, C, V]
  return jnp.moveaxis(o, (0, 2), (1, 3)).reshape(b, -1, hv, v.shape[-1])[:, :t].astype(v.dtype)


def jax_rule(variant):
  if variant == "maxtext":
    return maxtext_gated_delta_rule
  kernel, _, form = variant.partition("_")
  options = dict(state_kernel=kernel, chunk_dtype=jnp.bfloat16 if form == "bf16chunks" else None,
                 span_tokens=None if form == "whole" else SPAN_TOKENS)
  return lambda q, k, v, g, beta: gated_delta_rule(q, k, v, g, beta, **options)[0]


def jax_steps(variant):
  """(forward, forward + backward), jitted, each taking (q, k, v, g, beta, w)."""
  rule = jax_rule(variant)
  loss = lambda q, k, v, g, beta, w: jnp.sum(rule(q, k, v, g, beta).astype(jnp.float32) * w)
  return (jax.jit(lambda q, k, v, g, beta, w: rule(q, k, v, g, beta)),
          jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))))


def kernels(f, args, trace_dir, calls=2):
  """The ten longest kernels of one call of f on the first GPU: [(name, ms, launches)], from a trace of `calls`."""
  with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
    for _ in range(calls):
      out = f(*args)
    jax.block_until_ready(out)
  return kernel_times(find_trace(trace_dir), calls)["by_name"][:10]


def measure_jax(variant, args, iters, profile_dir=None):
  forward, both = jax_steps(variant)
  row = dict(fwd_ms=1e3 * seconds(forward, args, iters), fwd_bwd_ms=1e3 * seconds(both, args, iters))
  if profile_dir:
    shape = "x".join(map(str, args[2].shape[:2]))
    for name, f in (("fwd", forward), ("fwd_bwd", both)):
      row[f"{name}_kernels"] = kernels(f, args, os.path.join(profile_dir, f"{variant}_{shape}_{name}"))
  return row


def measure_fla(args, iters):
  """fla's forward (and backward where it runs) on the same inputs, timed with CUDA events."""
  # Imported here, where fla is measured: torch and fla are not dependencies (the GPU image has torch; fla is carried).
  import torch
  from fla.ops.gated_delta_rule import chunk_gated_delta_rule

  q, k, v, g, beta, w = (torch.from_numpy(np.asarray(x, np.float32)).cuda() for x in args)
  heads = v.shape[2]
  q, k = (x.repeat_interleave(heads // x.shape[2], dim=2).bfloat16().requires_grad_() for x in (q, k))
  v = v.bfloat16().requires_grad_()

  def forward():
    return chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]

  def timed(fn):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
      start.record()
      fn()
      end.record()
      torch.cuda.synchronize()
      times.append(start.elapsed_time(end))
    return float(np.median(times))

  row = dict(fwd_ms=timed(forward))
  try:
    row["fwd_bwd_ms"] = timed(lambda: (forward().float() * w).sum().backward())
  except Exception as err:  # fla refuses its backward on some Triton versions: the row says why
    row["fwd_bwd_ms"], row["note"] = None, f"backward: {str(err).splitlines()[0][:120]}"
  return row


def compiled_temporaries(variant, shape, heads, device):
  """GiB of temporaries of the forward and of forward + backward, compiled for `device` (compile-only)."""
  batch, tokens = shape
  sharding = jax.sharding.SingleDeviceSharding(device)
  args = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding) for x in jax.eval_shape(
      functools.partial(inputs, batch, tokens, *heads))]
  row = dict(fwd_ms=None, fwd_bwd_ms=None)
  lowered = {name: f.lower(*args) for name, f in zip(("fwd", "fwd_bwd"), jax_steps(variant))}
  for name, program in lowered.items():
    row[f"{name}_temp_gib"] = round(program.compile().memory_analysis().temp_size_in_bytes / 2**30, 2)
  row["note"] = f"compile-only: temporaries {row['fwd_temp_gib']} GiB fwd, {row['fwd_bwd_temp_gib']} fwd+bwd"
  if variant.startswith("pallas") and device.platform == "gpu":  # forward + backward holds every kernel
    registers = harness.kernel_registers(lowered["fwd_bwd"], "gated_delta_")
    if registers is not None:
      row["kernel_registers"] = [[kernel, *values] for kernel, values in registers.items()]
  return row


def measure(variant, shape, heads, iters, profile_dir=None, device=None):
  """A row: times on this machine's device, or with `device` (a compile-only one) compiled temporaries."""
  if device is not None:
    if variant == "fla":
      return dict(fwd_ms=None, fwd_bwd_ms=None, note="compile-only: fla is not JAX")
    return compiled_temporaries(variant, shape, heads, device)
  batch, tokens = shape
  args = inputs(batch, tokens, *heads)
  gpu = jax.default_backend() == "gpu"
  if (variant.startswith("pallas") or variant == "fla") and not gpu:
    return dict(fwd_ms=None, fwd_bwd_ms=None, note="needs a GPU")
  try:
    return measure_fla(args, iters) if variant == "fla" else measure_jax(variant, args, iters, profile_dir)
  except ImportError as err:
    return dict(fwd_ms=None, fwd_bwd_ms=None, note=f"not installed: {err.name}")
  except jax.errors.JaxRuntimeError as err:
    if "RESOURCE_EXHAUSTED" not in str(err):
      raise
    return dict(fwd_ms=None, fwd_bwd_ms=None, note="out of memory")


def table(rows):
  fla = {r["shape"]: r["fwd_ms"] for r in rows if r["variant"] == "fla" and r["fwd_ms"]}
  lines = ["| B x T | variant | fwd ms | fwd+bwd ms | fwd / fla fwd | fwd+bwd / fla fwd | note |",
           "|---|---|---|---|---|---|---|"]
  ms = lambda x: "—" if x is None else f"{x:.2f}"
  ratio = lambda x, shape: "—" if x is None or shape not in fla else f"{x / fla[shape]:.2f}"
  for r in rows:
    lines.append(f"| {r['shape']} | {r['variant']} | {ms(r['fwd_ms'])} | {ms(r['fwd_bwd_ms'])} | "
                 f"{ratio(r['fwd_ms'], r['shape'])} | {ratio(r['fwd_bwd_ms'], r['shape'])} | {r.get('note', '')} |")
  return "\n".join(lines)


def summary(rows):
  shape = rows[0]["shape"]
  value = lambda variant, key: next((f"{r[key]:.2f}" for r in rows if r["shape"] == shape and r["variant"] ==
                                     variant and r.get(key) is not None), "-")
  if any("fwd_bwd_temp_gib" in r for r in rows):  # --compile-only
    return f"summary: gated_deltanet_compile_only {shape} " + " ".join(
        f"{variant}_fwd_bwd_temp_gib={value(variant, 'fwd_bwd_temp_gib')}"
        for variant in dict.fromkeys(r["variant"] for r in rows if r["variant"] != "fla" and r["shape"] == shape))
  ours = "pallas" if any(r["variant"] == "pallas" and r["fwd_ms"] for r in rows) else "xla"
  return (f"summary: gated_deltanet {shape} variant={ours} fwd_ms={value(ours, 'fwd_ms')} "
          f"fwd_bwd_ms={value(ours, 'fwd_bwd_ms')} xla_fwd_bwd_ms={value('xla', 'fwd_bwd_ms')} "
          f"maxtext_fwd_bwd_ms={value('maxtext', 'fwd_bwd_ms')} fla_fwd_ms={value('fla', 'fwd_ms')}")


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shapes", default="16x4096,1x65536,1x262144")
  parser.add_argument("--variants", default=",".join(v for v in VARIANTS if v != "pallas_whole"),
                      help="default: all but pallas_whole (an A/B of the spans, not a comparison)")
  parser.add_argument("--key-heads", type=int, default=16)
  parser.add_argument("--value-heads", type=int, default=32)
  parser.add_argument("--head-dim", type=int, default=128)
  parser.add_argument("--iters", type=int, default=5)
  parser.add_argument("--out", default=os.path.join(harness.RESULTS, "gated_deltanet.json"))
  parser.add_argument("--profile", metavar="DIR", help="also trace each JAX variant under DIR: its longest kernels")
  parser.add_argument("--compile-only", action="store_true",
                      help="compile for one GPU without running: each pass's temporaries (needs the CUDA plugin)")
  parser.add_argument("--target-config", help="with --compile-only: the GPU (a GpuTargetConfigProto text file; "
                                              "default: this machine's)")
  args = parser.parse_args(argv)
  unknown = sorted(set(args.variants.split(",")) - set(VARIANTS))
  if unknown:
    parser.error(f"unknown variants {unknown}; known: {list(VARIANTS)}")
  heads = (args.key_heads, args.value_heads, args.head_dim)
  meta = dict(harness.machine(jax), command=harness.command_line("gated_deltanet", argv),
              key_heads=args.key_heads, value_heads=args.value_heads, head_dim=args.head_dim)
  device = None
  if args.compile_only:
    device = topology_devices("1x1x1", args.target_config)[0]
    meta["compiled_for"] = device.device_kind
  rows = []
  for shape in args.shapes.split(","):
    batch, tokens = map(int, shape.split("x"))
    for variant in args.variants.split(","):
      row = measure(variant, (batch, tokens), heads, args.iters, args.profile, device)
      rows.append(dict(shape=shape, variant=variant, **row))
      print(rows[-1], flush=True)
      write(meta, rows, args.out)  # after each row: a run cut short keeps what it measured
  print(write(meta, rows, args.out))


def write(meta, rows, out):
  """The JSON and table of `rows` so far; returns the table's text."""
  harness.write_json(dict(meta=meta, rows=rows), out)
  return harness.write_table(f"# {meta['command']}\n# {json.dumps(meta)}\n\n{table(rows)}\n{kernel_lines(rows)}"
                             f"{summary(rows)}", out)


def kernel_lines(rows):
  """The profiled rows' longest kernels, one block per row and pass ("" without --profile), and the compile-only
  rows' registers and spills per kernel (where ptxas was found)."""
  lines = []
  for r in rows:
    for name in ("fwd", "fwd_bwd"):
      if r.get(f"{name}_kernels"):
        lines += ["", f"{r['shape']} {r['variant']} {name}: longest kernels (ms, launches)"]
        lines += [f"  {ms:8.3f} {n:4d}  {kernel[:100]}" for kernel, ms, n in r[f"{name}_kernels"]]
    if r.get("kernel_registers"):
      lines += ["", f"{r['shape']} {r['variant']} fwd_bwd: registers per thread and bytes spilled per kernel (ptxas)"]
      lines += [f"  {registers:4d} {spills:6d}  {kernel}" for kernel, registers, spills in r["kernel_registers"]]
  return "\n".join(lines + [""]) if lines else ""


if __name__ == "__main__":
  main()
