"""Grouped-GEMM speed on one Hopper GPU: the Mosaic GPU kernels (ours and JAX's) against `lax.ragged_dot` and a
dense matmul.

    python -m benchmarks.grouped_gemm [--tune] [--quick] [--ep 8,2] [--out benchmarks/results/grouped_gemm.json]
    python -m benchmarks.grouped_gemm --merge A.json B.json --out C.json   # one table from several runs

For the per-hop shapes of the MoE layers (rows M = T·K/N with T = 32768 tokens per GPU, top-k K and ring size N;
L = E/N groups, random group sizes), each of a hop's two grouped matmuls (gate+up fused: contraction I = D, output
O = U = 2F; down: I = F, O = D) is timed as forward, input gradient and weight gradient, in bf16, next to
`lax.ragged_dot` (forward) and a dense matmul of equal FLOPs. Each is timed as the `mosaic_gpu` backend runs it
(ours from `hopper_grouped.MIN_ROWS` / `hopper_weight_grad.MIN_ROWS` rows, else JAX's) and on each kernel alone.
`--tune` first times candidate tiles of JAX's kernels for each shape and writes `relaymoe_jax/mosaic_gpu_tiles.json`.
Prints a table and writes JSON; the last line is the summary for the Qwen3-30B-A3B EP 8 shape (M 32768, I 2048,
O 768, L 16: one unfused gate or up projection of a hop, I = D, O = F), the shape at which the grouped-matmul
backends were first compared (`lax.ragged_dot` against the Mosaic GPU kernels and a dense matmul, on H200;
docs/design.md). In the JSON a row's `k`, `n` and `groups` are I, O and L.
"""

import argparse
import dataclasses
import functools
import itertools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import harness
from relaymoe_jax.kernels import hopper_grouped as hg, hopper_weight_grad as hw, mosaic_gpu as mg

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
  """One grouped matmul: an M × I operand against L groups of I × O (`k` is I, `n` is O, `groups` is L: the names
  the results files use)."""

  name: str
  m: int
  k: int
  n: int
  groups: int

  @property
  def flops(self):
    return 2 * self.m * self.k * self.n


def problems(quick, eps=None):
  """The summary shape, then each model's (the first only if `quick`) per-hop shapes at each EP size in `eps`
  (default: 8 if `quick`, else 8 and 2)."""
  eps = eps or ((8,) if quick else (8, 2))
  out = [Problem("qwen3_30b_ep8", 32768, 2048, 768, 16)]
  for model, (d, f, e, k) in MODELS.items():
    for ep in eps:
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


def _matmul(a, b):
  return a @ b


def _xla_ragged_dot(a, b, sizes):
  return jax.lax.ragged_dot(a, b, sizes, preferred_element_type=jnp.bfloat16)


def measure(p, with_xla):
  lhs, rhs, d_out, sizes = operands(p)

  def tflops(seconds):
    return p.flops / seconds / 1e12

  row = dict(dataclasses.asdict(p))
  row["fwd_tflops"] = tflops(timed(jax.jit(mg.forward), lhs, rhs, sizes))
  row["dgrad_tflops"] = tflops(timed(jax.jit(mg.lhs_grad), d_out, rhs, sizes))
  row["wgrad_tflops"] = tflops(timed(jax.jit(mg.rhs_grad), lhs, d_out, sizes))
  row["jax_wgrad_tflops"] = tflops(timed(_transposed_call(mg.tiles_for(mg.TRANSPOSED, p.k, p.n)), lhs, d_out, sizes))
  row["jax_fwd_tflops"] = tflops(timed(_ragged_call(mg.tiles_for(mg.RAGGED, p.k, p.n), False), lhs, rhs, sizes))
  row["jax_dgrad_tflops"] = tflops(timed(_ragged_call(mg.tiles_for(mg.RAGGED, p.n, p.k), True), d_out, rhs, sizes))
  fits = hg.takes(hg.MIN_ROWS, p.k, p.n, lhs.dtype), hg.takes(hg.MIN_ROWS, p.n, p.k, lhs.dtype)
  row["hopper_fwd_tflops"] = tflops(timed(jax.jit(hg.forward), lhs, rhs, sizes)) if fits[0] else None
  row["hopper_dgrad_tflops"] = tflops(timed(jax.jit(hg.lhs_grad), d_out, rhs, sizes)) if fits[1] else None
  fits_wgrad = hw.takes(hw.MIN_ROWS, p.k, p.n, lhs.dtype)
  row["hopper_wgrad_tflops"] = tflops(timed(jax.jit(hw.weight_grad), lhs, d_out, sizes)) if fits_wgrad else None
  row["tiles"] = {op: mg.tiles_for(op, kk, nn) for op, kk, nn in
                  ((mg.RAGGED, p.k, p.n), (mg.TRANSPOSED, p.k, p.n))}
  dense_rhs = rhs[0]
  row["dense_tflops"] = tflops(timed(jax.jit(_matmul), lhs, dense_rhs))
  row["xla_fwd_tflops"] = None
  if with_xla:
    row["xla_fwd_tflops"] = tflops(timed(jax.jit(_xla_ragged_dot), lhs, rhs, sizes, iters=3, repeats=1))
  return row


def _ragged_call(tiles, transpose_rhs):
  def call(a, b, s):
    return mg.ragged_dot_mgpu.ragged_dot(a, b, group_sizes=s, transpose_rhs=transpose_rhs, **tiles)
  return jax.jit(call)


def _transposed_call(tiles):
  def call(a, b, s):
    with jax.numpy_dtype_promotion("standard"):
      return mg.transposed_ragged_dot_mgpu.transposed_ragged_dot(a, b, group_sizes=s, **tiles)
  return jax.jit(call)


# The ragged kernel's candidates: block_m, block_n, pipeline stages (block_k 64), grid_block_n (output tiles along N
# run next to each other, sharing rows in L2). On the ring-of-one gate/up shape a wider search (block_k 128, 2–5
# stages, grid_block_n 1) found its best inside this set (moe_layer run 20's tune log, benchmarks/results/RUNS.md).
RAGGED_SEARCH = ((128, 192), (128, 192, 256), (3, 4), (2, 4, 8))


def tune(probs, ops=None):
  """Times candidate tiles per (op, I, O) of `ops` (default: both kernels) and the tiles in use, and writes the
  fastest into the tiles file after each (op, I, O): a tune stopped early keeps what it found, keys it does not
  reach keep their tiles."""
  table = {mg.RAGGED: {}, mg.TRANSPOSED: {}}
  for op, tiles in mg.tuned_tiles().items():
    table[op].update(tiles)
  done = {(op, None) for op in table if ops and op not in ops}
  ragged = [dict(block_m=bm, block_n=bn, block_k=64, max_concurrent_steps=s, grid_block_n=g)
            for bm, bn, s, g in itertools.product(*RAGGED_SEARCH)]
  transposed = [dict(block_m=bm, block_n=bn, block_k=bk, max_concurrent_steps=s, grid_block_n=g)
                for bm, bn, bk, s, g in itertools.product((64, 128), (128, 256), (64, 128), (4,), (1,))]
  for p in probs:
    lhs, rhs, d_out, sizes = operands(p)
    jobs = ((mg.RAGGED, ragged, p.k, p.n, functools.partial(_ragged_call, transpose_rhs=False), (lhs, rhs, sizes)),
            (mg.RAGGED, ragged, p.n, p.k, functools.partial(_ragged_call, transpose_rhs=True), (d_out, rhs, sizes)),
            (mg.TRANSPOSED, transposed, p.k, p.n, _transposed_call, (lhs, d_out, sizes)))
    for op, candidates, kk, nn, make, args in jobs:
      key = f"{kk}x{nn}"
      if (op, key) in done or (op, None) in done:
        continue
      done.add((op, key))
      best = None
      in_use = mg.tiles_for(op, kk, nn)
      for t in ([in_use] if in_use else []) + [c for c in candidates if c != in_use]:
        if not mg._fits(op, t, kk, nn):
          continue
        try:
          seconds = timed(make(t), *args, iters=3)
        except Exception as e:  # noqa: BLE001  (a candidate the kernel rejects is skipped)
          print(f"  {op} {key} {t}: {type(e).__name__}: {str(e)[:120]}", flush=True)
          continue
        if t == in_use:
          print(f"  {op} {key} in use {t}: {p.flops / seconds / 1e12:.0f} TFLOP/s", flush=True)
        if best is None or seconds < best[0]:
          best = (seconds, t)
      if best:
        table[op][key] = best[1]
        print(f"tuned {op} {key}: {best[1]} {p.flops / best[0] / 1e12:.0f} TFLOP/s", flush=True)
        mg.TILES_FILE.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
  mg.tuned_tiles.cache_clear()


def _tiles_in_use(r):
  return {op: mg.tiles_for(op, kk, nn) for op, kk, nn in ((mg.RAGGED, r["k"], r["n"]), (mg.TRANSPOSED, r["k"], r["n"]))}


def render(rows, runs):
  """The table under one header line per run; rows measured with other tiles than the committed ones are marked."""
  lines = [f"# {m['command']}\n#   {m['device']}, jax {m['jax']}, python {m['python']}"
           + (f"; {m['note']}" if "note" in m else "") for m in runs]
  lines += ["| shape | M | I | O | L | fwd | dgrad | wgrad | JAX fwd | JAX dgrad | JAX wgrad | ours fwd | ours dgrad "
            "| ours wgrad | xla fwd | dense |", "|" + "---|" * 16]

  def fmt(value):
    return "—" if value is None else f"{value:.0f}"

  stale = 0
  for r in rows:
    mark = "" if r.get("tiles") == _tiles_in_use(r) else " †"
    stale += bool(mark)
    lines.append(f"| {r['name']}{mark} | {r['m']} | {r['k']} | {r['n']} | {r['groups']} | {fmt(r['fwd_tflops'])} | "
                 f"{fmt(r['dgrad_tflops'])} | {fmt(r['wgrad_tflops'])} | "
                 + "".join(f"{fmt(r.get(f'{k}_tflops'))} | " for k in ("jax_fwd", "jax_dgrad", "jax_wgrad",
                                                                          "hopper_fwd", "hopper_dgrad", "hopper_wgrad",
                                                                          "xla_fwd", "dense")).rstrip())
  if stale:
    lines.append("† measured with other tiles than `relaymoe_jax/mosaic_gpu_tiles.json` gives now")
  s = next(r for r in rows if r["name"] == "qwen3_30b_ep8")
  lines.append(f"summary: grouped_gemm shape=qwen3_30b_ep8 fwd_tflops={s['fwd_tflops']:.1f} "
               f"wgrad_tflops={s['wgrad_tflops']:.1f} xla_fwd_tflops={s['xla_fwd_tflops'] or 0:.1f}")
  return "\n".join(lines)


def write(rows, runs, out):
  """JSON (one run's meta, or `runs`) and the table beside it."""
  harness.write_json(dict(meta=dict(runs=runs) if len(runs) > 1 else runs[0], rows=rows), out)
  return harness.write_table(render(rows, runs), out)


def merge(paths, out):
  """One results file from several runs: a later run's row of a shape replaces an earlier one, in place."""
  files = [harness.load_json(path) for path in paths]
  runs = [run for data in files for run in harness.runs_of(data["meta"])]
  return write(harness.merge_by_key([r for data in files for r in data["rows"]], lambda r: r["name"]), runs, out)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tune", action="store_true")
  parser.add_argument("--quick", action="store_true", help="the Qwen3-30B shapes only (at EP 8 unless --ep)")
  parser.add_argument("--tune-quick", action="store_true", help="tune on the Qwen3-30B EP 8 shapes, then measure all")
  parser.add_argument("--tune-ops", help="comma list of the kernels to tune: ragged_dot, transposed_ragged_dot")
  parser.add_argument("--ep", help="comma list of EP sizes whose per-hop shapes are measured and tuned (1: the ring "
                      "of one); default 8 with --quick, else 8,2")
  parser.add_argument("--merge", nargs="+", metavar="JSON", help="combine results files into --out")
  parser.add_argument("--out", default=os.path.join(harness.RESULTS, "grouped_gemm.json"))
  args = parser.parse_args(argv)
  if args.merge:
    print(merge(args.merge, args.out))
    return
  probs = problems(args.quick, args.ep and tuple(map(int, args.ep.split(","))))
  if args.tune or args.tune_quick:
    tuned = problems(True) if args.tune_quick else probs
    tune(tuned[1:] + tuned[:1], args.tune_ops and args.tune_ops.split(","))  # the summary shape last: its K×N
    # keys are the down projection's, transposed
  rows = []
  for p in probs:
    rows.append(measure(p, with_xla=p.groups <= 16))
    print(rows[-1], flush=True)
  meta = dict(command=harness.command_line("grouped_gemm", argv), **harness.machine(jax),
              device=jax.devices()[0].device_kind, tokens_per_gpu=TOKENS_PER_GPU)
  print(write(rows, [meta], args.out))


if __name__ == "__main__":
  main()
