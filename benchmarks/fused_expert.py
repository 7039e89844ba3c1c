"""The fused expert kernels against the unfused steps they replace, kernel by kernel, on one GPU.

    python -m benchmarks.fused_expert [--shapes ring_of_one,ep8_hop] [--iters 10] [--tune] [--out ...]

Per shape (M top-k rows of T tokens over L experts; Qwen3-30B's D 2048 and F 768), bf16, random token ids and
group sizes, each step of a hop's SwiGLU expert timed both ways:
  gate_up    fused `gate_up_swiglu` | unfused: x's row gather, the gate|up grouped matmul, SwiGLU
  down_grad  fused `down_grad`      | unfused: dy's row gather, the down projection's input gradient, SwiGLU's
                                      derivative, d(router weight) and the rows that feed W_down's gradient
  w_down     fused `weight_grad`    | unfused: dy's row gather, the weight-gradient grouped matmul
  w_gate_up  fused `weight_grad`    | unfused: x's row gather, the weight-gradient grouped matmul
The unfused steps run `--backend` (default: mosaic_gpu on Hopper GPUs, else xla); elsewhere than a GPU the fused
kernels run in Pallas's interpreter (`--shapes tiny`: what the tests run). `--tune` first times each candidate of
TUNE_SEARCH on the four fused steps of each shape and writes each kernel's fastest per D×F into
`relaymoe_jax/fused_tiles.json` (the last shape of a D×F decides). Prints a table, writes JSON; the summary line
sums the four steps of the first shape.
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
from relaymoe_jax import fused_kernels as fk
from relaymoe_jax.grouped_matmul import get_backend, matmul_options, resolve_backend

SHAPES = {  # name: (tokens T, rows M, groups L, D, F)
    "ring_of_one": (65536, 65536 * 8, 128, 2048, 768),
    "ep8_hop": (32768, 32768, 16, 2048, 768),
    "tiny": (64, 128, 4, 32, 32),
}
STEPS = ("gate_up", "down_grad", "w_down", "w_gate_up")


def _inputs(tokens, rows, groups, width, ffn, seed=0):
  k = jax.random.split(jax.random.key(seed), 7)
  bf16 = jnp.bfloat16
  sizes = np.random.default_rng(seed).multinomial(rows, np.full(groups, 1.0 / groups))
  return dict(
      x_TD=jax.random.normal(k[0], (tokens, width), bf16), dy_TD=jax.random.normal(k[1], (tokens, width), bf16),
      w_gate_up_LDU=(jax.random.normal(k[2], (groups, width, 2 * ffn)) / np.sqrt(width)).astype(bf16),
      w_down_LFD=(jax.random.normal(k[3], (groups, ffn, width)) / np.sqrt(ffn)).astype(bf16),
      tok_M=jax.random.randint(k[4], (rows,), 0, tokens), weight_M=jax.random.uniform(k[5], (rows,)),
      gate_up_MU=jax.random.normal(k[6], (rows, 2 * ffn), bf16), sizes_L=jnp.asarray(sizes, jnp.int32))


KERNEL_OF = {"gate_up": "gate_up_swiglu", "down_grad": "down_grad", "w_down": "weight_grad",
             "w_gate_up": "weight_grad"}


def fused_steps(tiles_of, interpret=False):
  """step → f(inputs) on the fused kernels, each with tiles_of(its kernel)."""
  o = {step: dict(tiles=tiles_of(kernel), interpret=interpret) for step, kernel in KERNEL_OF.items()}
  return {
      "gate_up": lambda a: fk.gate_up_swiglu(a["x_TD"], a["tok_M"], a["w_gate_up_LDU"], a["sizes_L"],
                                             **o["gate_up"]),
      "down_grad": lambda a: fk.down_grad(a["dy_TD"], a["tok_M"], a["w_down_LFD"], a["gate_up_MU"], a["weight_M"],
                                          a["sizes_L"], **o["down_grad"]),
      "w_down": lambda a: fk.weight_grad(a["gate_up_MU"][:, :a["w_down_LFD"].shape[1]], a["dy_TD"], a["sizes_L"],
                                         b_tok_M=a["tok_M"], **o["w_down"]),
      "w_gate_up": lambda a: fk.weight_grad(a["x_TD"], a["gate_up_MU"], a["sizes_L"], a_tok_M=a["tok_M"],
                                            **o["w_gate_up"]),
  }


def unfused_steps(backend):
  """step → f(inputs) as the plain path runs it: rows gathered, the backend's grouped matmuls, XLA's elementwise."""
  gmm = functools.partial(get_backend(backend), **matmul_options(jnp.bfloat16))

  def gate_up(a):
    gate, up = jnp.split(gmm(a["x_TD"][a["tok_M"]], a["w_gate_up_LDU"], a["sizes_L"]), 2, axis=1)
    return (jax.nn.silu(gate) * up).astype(jnp.bfloat16)

  def down_grad(a):
    dy_MD = a["dy_TD"][a["tok_M"]]
    h_shape = (dy_MD.shape[0], a["w_down_LFD"].shape[1])
    _, input_grad = jax.vjp(lambda h: gmm(h, a["w_down_LFD"], a["sizes_L"]), jnp.zeros(h_shape, jnp.bfloat16))
    (dh,) = input_grad(dy_MD.astype(jnp.float32))
    gate, up = jnp.split(a["gate_up_MU"].astype(jnp.float32), 2, axis=1)
    d_gate, d_up, hw, dw = fk.swiglu_grads(dh.astype(jnp.float32), gate, up, a["weight_M"][:, None], jnp.bfloat16)
    return jnp.concatenate([d_gate, d_up], axis=1).astype(jnp.bfloat16), hw.astype(jnp.bfloat16), dw

  def weight_grad(lhs_MI, w_LIO, d_out_MO, sizes_L):
    _, grad = jax.vjp(lambda w: gmm(lhs_MI, w, sizes_L), w_LIO)
    return grad(d_out_MO.astype(jnp.float32))[0]

  return {
      "gate_up": gate_up, "down_grad": down_grad,
      "w_down": lambda a: weight_grad(a["gate_up_MU"][:, :a["w_down_LFD"].shape[1]], a["w_down_LFD"],
                                      a["dy_TD"][a["tok_M"]], a["sizes_L"]),
      "w_gate_up": lambda a: weight_grad(a["x_TD"][a["tok_M"]], a["w_gate_up_LDU"], a["gate_up_MU"], a["sizes_L"]),
  }


# block_m, block_n, block_k, num_warps, num_stages
TUNE_SEARCH = ((64, 128), (64, 128), (32, 64), (4, 8), (3, 4))


def tune(shape, iters):
  """Times every candidate of TUNE_SEARCH on the four fused steps of `shape` and writes each kernel's fastest into
  the tiles file (the weight gradient's: the fastest for w_down and w_gate_up together). Returns a row per
  candidate and step."""
  tokens, rows, groups, width, ffn = SHAPES[shape]
  inputs = _inputs(tokens, rows, groups, width, ffn)
  interpret = jax.default_backend() != "gpu"  # elsewhere the search runs in the interpreter (the test's)
  timed = []
  for values in itertools.product(*TUNE_SEARCH):
    tiles = fk.Tiles(*values)
    if fk.TRITON._replace(tiles_for=lambda w, f, k, tiles=tiles: tiles, backward=True).unsupported(
        rows, width, ffn, jnp.bfloat16):
      continue
    try:
      steps = fused_steps(lambda kernel, tiles=tiles: tiles, interpret)
      ms = {step: 1e3 * _seconds(jax.jit(f), inputs, iters) for step, f in steps.items()}
    except Exception as e:  # noqa: BLE001  (a candidate Triton rejects, e.g. out of shared memory, is skipped)
      print(f"  {tiles}: {type(e).__name__}: {str(e)[:120]}", flush=True)
      continue
    print(f"  {tiles}: {', '.join(f'{k} {v:.3f}' for k, v in ms.items())} ms", flush=True)
    timed.append((tiles, ms))
  if not timed:
    raise SystemExit(f"no tiles of TUNE_SEARCH run the fused kernels at {shape}")
  best = {}
  for kernel in fk.KERNELS:
    steps = [step for step, k in KERNEL_OF.items() if k == kernel]
    tiles, ms = min(timed, key=lambda t: sum(t[1][step] for step in steps))
    best[kernel] = dataclasses.asdict(tiles)
    print(f"tuned {kernel} at {shape} ({width}x{ffn}): {tiles} {sum(ms[step] for step in steps):.3f} ms",
          flush=True)
  fk.TILES_FILE.write_text(json.dumps(dict(fk.tuned_tiles(), **{f"{width}x{ffn}": best}), indent=1,
                                      sort_keys=True) + "\n")
  fk.tuned_tiles.cache_clear()
  return [dict(shape=shape, step=step, ms=ms[step], tiles=dataclasses.asdict(tiles)) for tiles, ms in timed
          for step in STEPS]


def _seconds(f, inputs, iters):
  jax.block_until_ready(f(inputs))  # compile and warm up
  start = time.perf_counter()
  for _ in range(iters):
    out = f(inputs)
  jax.block_until_ready(out)
  return (time.perf_counter() - start) / iters


def measure(shape, backend, iters):
  tokens, rows, groups, width, ffn = SHAPES[shape]
  inputs = _inputs(tokens, rows, groups, width, ffn)
  on_gpu = jax.default_backend() == "gpu"
  tiles_of = functools.partial(fk.tiles_for, width, ffn) if on_gpu else lambda kernel: fk.Tiles(16, 16, 16)
  fused, unfused = fused_steps(tiles_of, interpret=not on_gpu), unfused_steps(backend)
  flops = {"gate_up": 4, "down_grad": 2, "w_down": 2, "w_gate_up": 4}
  out = []
  for step in STEPS:
    f_s, u_s = (_seconds(jax.jit(steps[step]), inputs, iters) for steps in (fused, unfused))
    tflop = flops[step] * rows * width * ffn / 1e12
    out.append(dict(shape=shape, step=step, rows=rows, groups=groups, fused_ms=1e3 * f_s, unfused_ms=1e3 * u_s,
                    fused_tflops=tflop / f_s, unfused_tflops=tflop / u_s, backend=backend,
                    tiles=dataclasses.asdict(tiles_of(KERNEL_OF[step]))))
  return out


def render(rows, meta):
  lines = [f"# {meta['command']}\n#   {meta['machine']}, jax {meta['jax']}, python {meta['python']}",
           "| shape | step | M | L | fused ms | unfused ms | fused TFLOP/s | unfused TFLOP/s | speedup |",
           "|" + "---|" * 9]
  for r in rows:
    lines.append(f"| {r['shape']} | {r['step']} | {r['rows']} | {r['groups']} | {r['fused_ms']:.3f} | "
                 f"{r['unfused_ms']:.3f} | {r['fused_tflops']:.0f} | {r['unfused_tflops']:.0f} | "
                 f"{r['unfused_ms'] / r['fused_ms']:.2f} |")
  first = [r for r in rows if r["shape"] == rows[0]["shape"]]
  fused, unfused = (sum(r[k] for r in first) for k in ("fused_ms", "unfused_ms"))
  lines.append(f"summary: fused_expert gpu={meta['device_kind'].replace(' ', '_')} shape={rows[0]['shape']} "
               f"fused_ms={fused:.2f} unfused_ms={unfused:.2f} speedup={unfused / fused:.2f}")
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shapes", default="ring_of_one,ep8_hop")
  parser.add_argument("--backend", default="auto", help="the unfused steps' grouped-matmul backend")
  parser.add_argument("--iters", type=int, default=10)
  parser.add_argument("--tune", action="store_true", help="tune the tiles of each shape's D×F first (GPU)")
  parser.add_argument("--out", default=os.path.join(harness.RESULTS, "fused_expert.json"))
  args = parser.parse_args(argv)
  backend = resolve_backend(args.backend)
  tuning = [r for shape in dict.fromkeys(args.shapes.split(",")) if args.tune
            for r in tune(shape, max(1, args.iters // 5))]
  rows = [r for shape in args.shapes.split(",") for r in measure(shape, backend, args.iters)]
  meta = dict(command=harness.command_line("fused_expert", argv), **harness.machine(jax))
  harness.write_json(dict(meta=meta, rows=rows, **({"tuning": tuning} if tuning else {})), args.out)
  print(harness.write_table(render(rows, meta), args.out))


if __name__ == "__main__":
  main()
