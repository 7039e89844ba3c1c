"""Compile-only per-device memory of one MoE layer, fwd+bwd: ring_expert against all-to-all.

    python -m benchmarks.moe_memory [--devices 8] [--quick]

Nothing runs: each variant is lowered and compiled for the emulated CPU devices and XLA's `memory_analysis()` gives
the per-device peak of live temporaries. Every variant uses the `xla_scan` grouped matmul, whose memory is that of
a grouped kernel (M×N), not that of `lax.ragged_dot`'s dense CPU fallback (G×M×N), which would inflate every
variant's grouped-matmul temporaries by the experts per device.
Prints a table and writes JSON under benchmarks/results/.
"""

import argparse
import dataclasses
import json
import os
import platform
import sys

if __name__ == "__main__" and "jax" not in sys.modules:
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import relaymoe_jax as rm
from benchmarks.harness import RESULTS


@dataclasses.dataclass(frozen=True)
class LayerShape:
  tokens_per_device: int
  d_model: int
  d_ff: int
  num_experts: int
  top_k: int


VARIANTS = {
    "ring_expert": ("ring_expert", {}),
    "ring_token": ("ring_token", {}),
    "auto": ("auto", {}),
    "ring_expert_autodiff": ("ring_expert", {"recompute": False}),
    "a2a_dropless": ("all_to_all", {}),
    "a2a_cf1": ("all_to_all", {"capacity_factor": 1.0}),
}
MEMORY_BACKEND = "xla_scan"
# Per-hop bytes of the two ring modes at the paper's real sizes (D 2048, top-8, EP 8, bf16), from the volume model.
MODE_CONFIGS = [("E128 F768 (Qwen3-30B)", 128, 768), ("E64 F512", 64, 512), ("E128 F2048", 128, 2048),
                ("E384 F768", 384, 768), ("E384 F2048", 384, 2048)]
MODE_TOKENS = (2048, 8192, 32768, 65536)


def expert_mesh(num_devices, backend="cpu"):
  """A ring of emulated CPU devices by default: compile-only analysis needs no accelerator, and XLA:CPU's numbers
  are the ones committed."""
  devices = jax.devices(backend)
  if len(devices) < num_devices:
    raise ValueError(f"{num_devices} {backend} devices wanted, {len(devices)} present; set XLA_FLAGS="
                     f"--xla_force_host_platform_device_count={num_devices} before JAX starts")
  return jax.sharding.Mesh(np.array(devices[:num_devices]), (rm.EXPERT,))


def fwd_bwd_memory(variant, shape, mesh, dtype=jnp.float32):
  """Compiled per-device bytes (temporaries, arguments, outputs) of value_and_grad through one MoE layer."""
  dispatcher, options = VARIANTS[variant]
  options = dict(options, backend=MEMORY_BACKEND)
  t = shape.tokens_per_device * mesh.size
  e, d, f, k = shape.num_experts, shape.d_model, shape.d_ff, shape.top_k
  tok, exp = NamedSharding(mesh, P(rm.EXPERT)), NamedSharding(mesh, P(rm.EXPERT))
  args = (jax.ShapeDtypeStruct((t, d), dtype, sharding=tok), jax.ShapeDtypeStruct((t, k), jnp.int32, sharding=tok),
          jax.ShapeDtypeStruct((t, k), dtype, sharding=tok), jax.ShapeDtypeStruct((e, d, f), dtype, sharding=exp),
          jax.ShapeDtypeStruct((e, d, f), dtype, sharding=exp), jax.ShapeDtypeStruct((e, f, d), dtype, sharding=exp))

  def loss(x, idx, w, wg, wu, wd):
    # A loss whose gradient depends on y, as in training. With sum(y) the cotangent is a constant, and XLA may run
    # a ring's backward (which needs only the inputs and the pair plan) alongside its forward, both peaks at once.
    y = rm.moe_ffn(x, idx, w, wg, wu, wd, mesh=mesh, dispatcher=dispatcher, **options)
    return jnp.sum(y.astype(jnp.float32) ** 2)

  grad_fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 2, 3, 4, 5)))
  analysis = grad_fn.lower(*args).compile().memory_analysis()
  return dict(temp_bytes=int(analysis.temp_size_in_bytes), argument_bytes=int(analysis.argument_size_in_bytes),
              output_bytes=int(analysis.output_size_in_bytes))


def grid(quick):
  """The paper's scaling grid (K 4–16, E 64/128 at D 2048, F 768) scaled to CPU by 1/8 in D and F, then a wide-expert
  case (E384, F2048 → 256) with few tokens and a narrow one (E64, F512 → 64) with many."""
  if quick:
    return [LayerShape(tokens_per_device=512, d_model=256, d_ff=96, num_experts=64, top_k=8)]
  paper = [LayerShape(tokens_per_device=1024, d_model=256, d_ff=96, num_experts=e, top_k=k)
           for e in (64, 128) for k in (4, 8, 12, 16)]
  return paper + [LayerShape(tokens_per_device=256, d_model=256, d_ff=256, num_experts=384, top_k=8),
                  LayerShape(tokens_per_device=4096, d_model=256, d_ff=64, num_experts=64, top_k=8)]


def mode_rows():
  rows = []
  for name, e, f in MODE_CONFIGS:
    for t in MODE_TOKENS:
      plan = rm.plan_dispatch(tokens_per_device=t, d_model=2048, d_ff=f, num_experts=e, top_k=8, ring_size=8)
      rows.append(dict(config=name, tokens_per_device=t, mode=plan.mode,
                       expert_bytes_per_hop=plan.expert_routing.bytes_per_hop,
                       token_bytes_per_hop=plan.token_routing.bytes_per_hop))
  return rows


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--devices", type=int, default=8)
  parser.add_argument("--platform", default="cpu", help="devices to compile for (default: emulated CPU devices)")
  parser.add_argument("--quick", action="store_true", help="one shape (K8, E64), for a smoke run")
  parser.add_argument("--out", default=os.path.join(RESULTS, "moe_memory.json"))
  args = parser.parse_args(argv)
  mesh = expert_mesh(args.devices, args.platform)
  rows = []
  for shape in grid(args.quick):
    row = dict(dataclasses.asdict(shape), ep=args.devices)
    for variant in VARIANTS:
      row[variant] = fwd_bwd_memory(variant, shape, mesh)
    rows.append(row)
    print(_format_row(row), flush=True)
  meta = dict(command="python -m benchmarks.moe_memory " + " ".join(argv if argv is not None else sys.argv[1:]),
              machine=platform.machine(), python=platform.python_version(), jax=jax.__version__,
              backend=args.platform, devices=args.devices, dtype="float32",
              xla_flags=os.environ.get("XLA_FLAGS", ""), measure="compile-only memory_analysis().temp_size_in_bytes")
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  modes = mode_rows()
  with open(args.out, "w") as fh:
    json.dump(dict(meta=meta, rows=rows, mode_rows=modes), fh, indent=1)
  table = render_mode_table(modes) + "\n\n" + render_table(rows, meta)
  with open(os.path.splitext(args.out)[0] + ".txt", "w") as fh:
    fh.write(table + "\n")
  print(table)


def _mib(b):
  return f"{b / 2**20:9.2f}"


def render_mode_table(modes):
  lines = ["# ring modes: bytes one device sends per hop (forward + backward), volume model, D=2048 K=8 EP=8 bf16",
           "| experts | T/dev | ring_expert MiB/hop | ring_token MiB/hop | auto picks |", "|---|---|---|---|---|"]
  lines += [f"| {r['config']} | {r['tokens_per_device']} | {r['expert_bytes_per_hop'] / 2**20:.1f} | "
            f"{r['token_bytes_per_hop'] / 2**20:.1f} | {r['mode']} |" for r in modes]
  return "\n".join(lines)


def _format_row(row):
  temps = {v: row[v]["temp_bytes"] for v in VARIANTS}
  ring = temps["ring_expert"]
  return (f"| {row['ep']:>2} | {row['num_experts']:>3} | {row['top_k']:>2} | {row['d_ff']:>3} | "
          f"{row['tokens_per_device']:>5} | "
          + " | ".join(_mib(temps[v]) for v in VARIANTS)
          + f" | {temps['a2a_dropless'] / ring:6.2f} | {temps['a2a_cf1'] / ring:6.2f} |"
          + f" {temps['ring_expert_autodiff'] / ring:6.2f} |")


def render_table(rows, meta):
  head = ("| EP |   E |  K |   F | T/dev | " + " | ".join(f"{v} MiB" for v in VARIANTS)
          + " | dropless/ring | cf1/ring | autodiff/ring |")
  lines = [f"# moe_memory: fwd+bwd compiled temporaries per device ({meta['backend']}, jax {meta['jax']}, "
           f"python {meta['python']}, {meta['dtype']}, D=256)", head,
           "|" + "|".join("---" for _ in head.split("|")[1:-1]) + "|"]
  lines += [_format_row(r) for r in rows]
  pick = next((r for r in rows if r["top_k"] == 8), rows[0])
  ring, a2a = pick["ring_expert"]["temp_bytes"], pick["a2a_dropless"]["temp_bytes"]
  lines.append(f"summary: moe_memory ep={pick['ep']} k={pick['top_k']} ring_temp_bytes={ring} a2a_temp_bytes={a2a} "
               f"ratio={a2a / ring:.2f}")
  return "\n".join(lines)


if __name__ == "__main__":
  main()
