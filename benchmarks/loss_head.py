"""The LM head and loss on one device: the gradient from the forward against the recomputing backward, and the
dense matmul roof.

    python -m benchmarks.loss_head [--tokens 65536] [--d-model 2048] [--vocab 151936]
                                   [--recompute-chunks 1024,8192] [--forward-chunks 1024,2048,4096,8192,16384]
                                   [--iters 5] [--out benchmarks/results/loss_head.json]

Each variant is the mean cross-entropy of bf16 hidden states x [tokens, D] (16 sequences) and a bf16 head [D, V]
with its gradients in x and the head (`jax.value_and_grad`), as the train step runs it:
  recompute       `chunked_cross_entropy(...).mean()`: vocabulary tiles of 16384, the backward recomputes the logits
                  (four matmuls: 8·T·D·V FLOPs);
  forward_grad    `mean_cross_entropy`: per chunk the logits over the whole vocabulary once, dx and dhead in the
                  forward (three matmuls: 6·T·D·V);
  matmul          the roof: x [T, D] · head [D, V] alone, bf16 in, float32 accumulation, bf16 out (2·T·D·V).
TFLOP/s count the head's useful FLOPs, 6·T·D·V (2·T·D·V for `matmul`); `x roof` is a variant's time over three
`matmul`s (the issue's target: 1.15). Prints a table and writes JSON; the last line is the summary.
"""

import argparse
import functools
import json
import os

import jax
import jax.numpy as jnp

from benchmarks import harness
from benchmarks.cp_attention import seconds
from models.loss import chunked_cross_entropy, mean_cross_entropy

SEQUENCES = 16
AXES = ("data", "expert")


def _inputs(tokens, d_model, vocab):
  keys = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(keys[0], (SEQUENCES, tokens // SEQUENCES, d_model), jnp.bfloat16)
  head = (jax.random.normal(keys[1], (d_model, vocab), jnp.float32) * d_model ** -0.5).astype(jnp.bfloat16)
  return x, head, jax.random.randint(keys[2], x.shape[:2], 0, vocab)


def _step(variant, chunk, mesh):
  if variant == "matmul":
    return jax.jit(lambda x, head, labels: jnp.dot(x, head, preferred_element_type=jnp.float32).astype(x.dtype))
  options = dict(mesh=mesh, token_axes=AXES, chunk_tokens=chunk)
  loss = (functools.partial(mean_cross_entropy, **options) if variant == "forward_grad" else
          lambda x, head, labels: chunked_cross_entropy(x, head, labels, **options).mean())
  return jax.jit(jax.value_and_grad(loss, (0, 1)))


def measure(variant, chunk, inputs, iters):
  mesh = jax.make_mesh((1, 1), AXES, axis_types=(jax.sharding.AxisType.Auto,) * 2, devices=jax.devices()[:1])
  elapsed = seconds(_step(variant, chunk, mesh), inputs, iters)
  x, head, _ = inputs
  flops = (2 if variant == "matmul" else 6) * x.shape[0] * x.shape[1] * head.shape[0] * head.shape[1]
  return dict(variant=variant, chunk=chunk, ms=1e3 * elapsed, tflops=flops / elapsed / 1e12)


def table(rows):
  roof = next((r["ms"] for r in rows if r["variant"] == "matmul"), None)
  lines = ["| variant | chunk tokens | ms | TFLOP/s | x roof |", "|---|---|---|---|---|"]
  for r in rows:
    ratio = f"{r['ms'] / (3 * roof):.2f}" if roof and r["variant"] != "matmul" else "-"
    lines.append(f"| {r['variant']} | {r['chunk'] or '-'} | {r['ms']:.1f} | {r['tflops']:.3g} | {ratio} |")
  return "\n".join(lines)


def summary(rows, tokens):
  def best(variant):
    times = [r["ms"] for r in rows if r["variant"] == variant]
    return f"{min(times):.1f}" if times else "-"

  gpu = jax.devices()[0].device_kind.replace(" ", "_")
  return (f"summary: loss_head gpu={gpu} tokens={tokens} recompute_ms={best('recompute')} "
          f"forward_grad_ms={best('forward_grad')} matmul_roof_ms={best('matmul')}")


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tokens", type=int, default=65536)
  parser.add_argument("--d-model", type=int, default=2048)
  parser.add_argument("--vocab", type=int, default=151936)
  parser.add_argument("--recompute-chunks", default="1024,8192")
  parser.add_argument("--forward-chunks", default="1024,2048,4096,8192,16384")
  parser.add_argument("--iters", type=int, default=5)
  parser.add_argument("--out", default=os.path.join(harness.RESULTS, "loss_head.json"))
  args = parser.parse_args(argv)
  inputs = _inputs(args.tokens, args.d_model, args.vocab)
  variants = ([("matmul", None)] + [("recompute", int(c)) for c in args.recompute_chunks.split(",") if c]
              + [("forward_grad", int(c)) for c in args.forward_chunks.split(",") if c])
  rows = []
  for variant, chunk in variants:
    rows.append(measure(variant, chunk, inputs, args.iters))
    print(rows[-1], flush=True)
  meta = dict(harness.machine(jax), command=harness.command_line("loss_head", argv), tokens=args.tokens,
              d_model=args.d_model, vocab=args.vocab)
  text = f"# {meta['command']}\n# {json.dumps(meta)}\n\n{table(rows)}\n{summary(rows, args.tokens)}"
  harness.write_json(dict(meta=meta, rows=rows), args.out)
  print(harness.write_table(text, args.out))


if __name__ == "__main__":
  main()
