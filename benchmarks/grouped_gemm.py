"""Grouped-GEMM speed on one Hopper GPU: the Mosaic GPU kernels against `lax.ragged_dot` and a dense matmul.

    python -m benchmarks.grouped_gemm [--tune] [--quick] [--out benchmarks/results/grouped_gemm.json]

For the per-hop shapes of the MoE layers (rows M = T·K/N with T = 32768 tokens per GPU, G = E/N groups, random
group sizes), each of a hop's two grouped matmuls (gate+up fused: K=D, N=2F; down: K=F, N=D) is timed as forward,
input gradient and weight gradient, in bf16, next to `lax.ragged_dot` (forward) and a dense matmul of equal FLOPs.
`--tune` first times candidate tiles for each shape and writes `relaymoe_jax/mosaic_gpu_tiles.json`.
Prints a table and writes JSON; the last line is the summary for the Qwen3-30B-A3B EP 8 shape (M32768 K2048 N768
G16, the shape DESIGN.md measured).
"""

import argparse
import dataclasses
import itertools
import json
import os
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

RESULTS = os.path.join(os.path.dirname(__file__), "results")
TOKENS_PER_GPU = 32768
MODELS = {  # name: (D, F, E, K)
    "qwen3_30b": (2048, 768, 128, 8),
    "qwen2_57b": (3584, 2560, 64, 8),
    "grid_e384_f2048": (2048, 2048, 384, 8),
    "grid_e64_f512": (2048, 512, 64, 8),
    "grid_e128_k16": (2048, 768, 128, 16),
}


@dataclasses.dataclass(frozen=True)
class Problem:
  name: str
  m: int
  k: int
  n: int
  groups: int

  @property
  def flops(self):
    return 2 * self.m * self.k * self.n


def problems(quick):
  out = [Problem("qwen3_30b_ep8", 32768, 2048, 768, 16)]
  for model, (d, f, e, k) in MODELS.items():
    for ep in ((8,) if quick else (8, 2)):
      m = TOKENS_PER_GPU * k // ep
      out += [Problem(f"{model}_ep{ep}_gate_up", m, d, 2 * f, e // ep),
              Problem(f"{model}_ep{ep}_down", m, f, d, e // ep)]
    if quick:
      break
  return out


def group_sizes(p, seed=0):
  rng = np.random.default_rng(seed)
  return jnp.asarray(rng.multinomial(p.m, np.full(p.groups, 1.0 / p.groups)), jnp.int32)


def timed(f, *args, iters=10, repeats=3):
  """Seconds per call of a jitted function: calls queued back to back (no host sync between them, so dispatch
  overhead is hidden as in a training step), best of `repeats` runs, after a compile-and-warm-up call."""
  jax.block_until_ready(f(*args))
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    for _ in range(iters):
      out = f(*args)
    jax.block_until_ready(out)
    best = min(best, (time.perf_counter() - start) / iters)
  return best


def operands(p):
  keys = jax.random.split(jax.random.key(0), 3)
  lhs = jax.random.normal(keys[0], (p.m, p.k), jnp.bfloat16)
  rhs = (jax.random.normal(keys[1], (p.groups, p.k, p.n), jnp.float32) / np.sqrt(p.k)).astype(jnp.bfloat16)
  d_out = jax.random.normal(keys[2], (p.m, p.n), jnp.bfloat16)
  return lhs, rhs, d_out, group_sizes(p)


def measure(p, with_xla):
  from relaymoe_jax import mosaic_gpu as mg  # noqa: PLC0415
  lhs, rhs, d_out, sizes = operands(p)
  tflops = lambda s: p.flops / s / 1e12  # noqa: E731
  row = dict(dataclasses.asdict(p))
  row["fwd_tflops"] = tflops(timed(jax.jit(mg.forward), lhs, rhs, sizes))
  row["dgrad_tflops"] = tflops(timed(jax.jit(mg.lhs_grad), d_out, rhs, sizes))
  row["wgrad_tflops"] = tflops(timed(jax.jit(mg.rhs_grad), lhs, d_out, sizes))
  row["tiles"] = {op: mg.tiles_for(op, kk, nn) for op, kk, nn in
                  ((mg.RAGGED, p.k, p.n), (mg.TRANSPOSED, p.k, p.n))}
  dense_rhs = rhs[0]
  row["dense_tflops"] = tflops(timed(jax.jit(lambda a, b: a @ b), lhs, dense_rhs))
  row["xla_fwd_tflops"] = None
  if with_xla:
    xla = jax.jit(lambda a, b, s: jax.lax.ragged_dot(a, b, s, preferred_element_type=jnp.bfloat16))
    row["xla_fwd_tflops"] = tflops(timed(xla, lhs, rhs, sizes, iters=3, repeats=1))
  return row


def _ragged_call(mg, tiles, transpose_rhs):
  return jax.jit(lambda a, b, s: mg.ragged_dot_mgpu.ragged_dot(a, b, group_sizes=s, transpose_rhs=transpose_rhs,
                                                               **tiles))


def _transposed_call(mg, tiles):
  def call(a, b, s):
    with jax.numpy_dtype_promotion("standard"):
      return mg.transposed_ragged_dot_mgpu.transposed_ragged_dot(a, b, group_sizes=s, **tiles)
  return jax.jit(call)


def tune(probs):
  """Times candidate tiles per (op, K, N) and writes the fastest into the tiles file."""
  from relaymoe_jax import mosaic_gpu as mg  # noqa: PLC0415
  table = {mg.RAGGED: {}, mg.TRANSPOSED: {}}
  ragged = [dict(block_m=bm, block_n=bn, block_k=64, max_concurrent_steps=s, grid_block_n=g)
            for bm, bn, s, g in itertools.product((128, 192), (128, 256), (4,), (1, 2))]
  transposed = [dict(block_m=bm, block_n=bn, block_k=bk, max_concurrent_steps=s, grid_block_n=g)
                for bm, bn, bk, s, g in itertools.product((64, 128), (128, 256), (64, 128), (4,), (1,))]
  for p in probs:
    lhs, rhs, d_out, sizes = operands(p)
    jobs = ((mg.RAGGED, ragged, p.k, p.n, lambda t: _ragged_call(mg, t, False), (lhs, rhs, sizes)),
            (mg.RAGGED, ragged, p.n, p.k, lambda t: _ragged_call(mg, t, True), (d_out, rhs, sizes)),
            (mg.TRANSPOSED, transposed, p.k, p.n, lambda t: _transposed_call(mg, t), (lhs, d_out, sizes)))
    for op, candidates, kk, nn, make, args in jobs:
      key = f"{kk}x{nn}"
      if key in table[op]:
        continue
      best = None
      for t in candidates:
        if not mg._fits(op, t, kk, nn):
          continue
        try:
          seconds = timed(make(t), *args, iters=3)
        except Exception as e:  # noqa: BLE001  (a candidate the kernel rejects is skipped)
          print(f"  {op} {key} {t}: {type(e).__name__}: {str(e)[:120]}", flush=True)
          continue
        if best is None or seconds < best[0]:
          best = (seconds, t)
      if best:
        table[op][key] = best[1]
        print(f"tuned {op} {key}: {best[1]} {p.flops / best[0] / 1e12:.0f} TFLOP/s", flush=True)
  mg.TILES_FILE.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
  mg.tuned_tiles.cache_clear()


def render(rows, meta):
  head = "| shape | M | K | N | G | fwd | dgrad | wgrad | xla fwd | dense |"
  lines = [f"# grouped_gemm TFLOP/s, bf16 ({meta['device']}, jax {meta['jax']}, python {meta['python']})", head,
           "|" + "---|" * 10]
  fmt = lambda v: "—" if v is None else f"{v:.0f}"  # noqa: E731
  for r in rows:
    lines.append(f"| {r['name']} | {r['m']} | {r['k']} | {r['n']} | {r['groups']} | {fmt(r['fwd_tflops'])} | "
                 f"{fmt(r['dgrad_tflops'])} | {fmt(r['wgrad_tflops'])} | {fmt(r['xla_fwd_tflops'])} | "
                 f"{fmt(r['dense_tflops'])} |")
  s = rows[0]
  lines.append(f"summary: grouped_gemm shape=qwen3_30b_ep8 fwd_tflops={s['fwd_tflops']:.1f} "
               f"wgrad_tflops={s['wgrad_tflops']:.1f} xla_fwd_tflops={s['xla_fwd_tflops'] or 0:.1f}")
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tune", action="store_true")
  parser.add_argument("--quick", action="store_true", help="the Qwen3-30B EP 8 shapes only")
  parser.add_argument("--tune-quick", action="store_true", help="tune on the Qwen3-30B EP 8 shapes, then measure all")
  parser.add_argument("--out", default=os.path.join(RESULTS, "grouped_gemm.json"))
  args = parser.parse_args(argv)
  probs = problems(args.quick)
  if args.tune or args.tune_quick:
    tune(problems(True) if args.tune_quick else probs)
  rows = []
  for p in probs:
    rows.append(measure(p, with_xla=p.groups <= 16))
    print(rows[-1], flush=True)
  meta = dict(command="python -m benchmarks.grouped_gemm " + " ".join(sys.argv[1:] if argv is None else argv),
              device=jax.devices()[0].device_kind, jax=jax.__version__, python=platform.python_version(),
              xla_flags=os.environ.get("XLA_FLAGS", ""), tokens_per_gpu=TOKENS_PER_GPU)
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w") as fh:
    json.dump(dict(meta=meta, rows=rows), fh, indent=1)
  table = render(rows, meta)
  with open(os.path.splitext(args.out)[0] + ".txt", "w") as fh:
    fh.write(table + "\n")
  print(table)


if __name__ == "__main__":
  main()
