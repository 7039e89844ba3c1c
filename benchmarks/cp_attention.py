"""Context-parallel attention on one GPU: the tile loop a device runs, against cuDNN's causal attention.

    python -m benchmarks.cp_attention [--tokens 65536,262144] [--variants cudnn_whole,cudnn_tiles,xla_tiles]
                                      [--xla-max-tokens 65536] [--out benchmarks/results/cp_attention.json]
    python -m benchmarks.cp_attention --batch 16 --tokens 4096 --mean-doc 1024 \
        --variants cudnn_whole,cudnn_documents,cudnn_documents_bias [--documents-per-row 16] [--rows-per-call auto,0] \
        --out benchmarks/results/documents_attention.json

Under context parallelism over N devices a device attends its two chunks to their causal prefix tile pair by tile
pair (`models/attention/context_parallel.py`): 1/N of the sequence's causal work. On one GPU the same loop runs over a mesh
of one device (the sequence's two chunks against their prefix, no gather), so S tokens here are the work a device
does for a sequence of S·√N (a 4M-token sequence over 8 devices: S = 1.48M). Qwen3-30B-A3B's attention (32 query
heads, 4 K/V heads, head_dim 128), --batch sequences (one), bfloat16, forward and forward+backward of one layer:
  cudnn_whole  `jax.nn.dot_product_attention(implementation="cudnn", is_causal=True)`: the path without CP;
  cudnn_tiles  the CP loop on cuDNN tile pairs (`CUDNN_TILES`, tiles of up to --tile rows; with --mean-doc the
               documents too: key tiles a query tile's documents cannot reach skipped, the rest masked);
  xla_tiles    the CP loop on XLA's tile pairs (`XLA_TILES`, 512 rows), only up to --xla-max-tokens;
  cudnn_documents  with --mean-doc: each row packed documents (exponential lengths of that mean) that do not see
               each other, on the model's path without CP (`models.attention.cudnn_documents`: cuDNN's packed layout, at
               most --documents-per-row documents a row, else the tile loop over one device; --rows-per-call rows a
               call, 0: all, auto: the model's choice, `rows_per_call`);
  cudnn_documents_bias  the same documents, their mask passed to `jax.nn.dot_product_attention` (a bias for cuDNN);
               the documents' TFLOP/s count every causal pair, the masked ones too.
TFLOP/s count the causal pairs only (forward 4·S²/2·heads·head_dim, forward+backward 3.5× that); temporaries are
the compiled forward+backward's (XLA's memory analysis: cuDNN's workspaces included). Prints a table
and writes JSON; the last line is the summary at the largest length.
"""

import argparse
import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import harness
from models.attention.context_parallel import XLA_TILES, context_attention
from models.attention.cudnn import CUDNN_TILES
from models.attention.cudnn_documents import DOCUMENTS_PER_ROW, documents_attention, rows_per_call
from models.attention.documents import same_document
from models.sharding import MESH_AXES

QUERY_HEADS, KV_HEADS, HEAD_DIM = 32, 4, 128


def _attend(variant, mesh, tile, segments_BS, documents_per_row, rows_per_call):
  scale = HEAD_DIM ** -0.5
  if variant == "cudnn_documents":
    return lambda q, k, v: documents_attention(q, k, v, segments_BS, scale, documents_per_row, rows_per_call)
  if variant == "cudnn_documents_bias":
    return functools.partial(jax.nn.dot_product_attention, scale=scale, is_causal=True, implementation="cudnn",
                             mask=same_document(segments_BS)[:, None])
  if variant == "cudnn_whole":
    return functools.partial(jax.nn.dot_product_attention, scale=scale, is_causal=True, implementation="cudnn")
  kernels = {"cudnn_tiles": CUDNN_TILES, "xla_tiles": XLA_TILES}[variant]
  return functools.partial(context_attention, mesh=mesh, scale=scale, kernels=kernels,
                           tile=tile if variant == "cudnn_tiles" else None, segment_ids_BS=segments_BS)


def seconds(f, args, iters):
  """Median wall seconds of f(*args) over `iters` calls, after one to compile and warm up."""
  jax.block_until_ready(f(*args))  # compile and warm up
  times = []
  for _ in range(iters):
    start = time.perf_counter()
    jax.block_until_ready(f(*args))
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def documents(batch, tokens, mean_doc, seed=0):
  """[batch, tokens] segment ids of packed documents of exponential lengths of mean `mean_doc` (at least 1)."""
  rng = np.random.default_rng(seed)
  lengths = np.maximum(rng.exponential(mean_doc, size=(batch, tokens)).astype(np.int64), 1)
  ends = np.cumsum(lengths, axis=1)
  inside = ends < tokens
  starts = np.zeros((batch, tokens), np.int32)
  starts[np.nonzero(inside)[0], ends[inside]] = 1
  return jnp.asarray(np.cumsum(starts, axis=1), jnp.int32)


def measure(variant, tokens, tile, iters, batch=1, mean_doc=0, documents_per_row=DOCUMENTS_PER_ROW, rows_per_call=None):
  mesh = jax.make_mesh((1, 1, 1), MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3, devices=jax.devices()[:1])
  keys = jax.random.split(jax.random.key(0), 4)
  q, k, v, do = (jax.random.normal(key, (batch, tokens, h, HEAD_DIM), jnp.bfloat16)
                 for key, h in zip(keys, (QUERY_HEADS, KV_HEADS, KV_HEADS, QUERY_HEADS)))
  segments_BS = documents(batch, tokens, mean_doc) if mean_doc else None
  attend = _attend(variant, mesh, tile, segments_BS, documents_per_row, rows_per_call)

  def forward_backward(q, k, v, do):
    out, vjp = jax.vjp(attend, q, k, v)
    return out, vjp(do)

  fwd = seconds(jax.jit(attend), (q, k, v), iters)
  both = seconds(jax.jit(forward_backward), (q, k, v, do), iters)
  temp = jax.jit(forward_backward).lower(q, k, v, do).compile().memory_analysis().temp_size_in_bytes
  flops = batch * 4 * tokens * (tokens + 1) / 2 * QUERY_HEADS * HEAD_DIM
  most = None if segments_BS is None else int(jnp.max(segments_BS[:, -1] - segments_BS[:, 0])) + 1
  return dict(variant=variant, batch=batch, mean_doc=mean_doc or None, most_documents_in_a_row=most,
              documents_per_row=documents_per_row if variant == "cudnn_documents" else None,
              rows_per_call=rows_per_call if variant == "cudnn_documents" else None, tokens=tokens,
              fwd_bwd_temp_gib=temp / 2**30,
              tile=tile if variant == "cudnn_tiles" else None, fwd_ms=1e3 * fwd,
              fwd_bwd_ms=1e3 * both, bwd_ms=1e3 * (both - fwd), fwd_tflops=flops / fwd / 1e12,
              fwd_bwd_tflops=3.5 * flops / both / 1e12)


def table(rows):
  lines = ["| variant | rows × tokens | most documents in a row | tile | fwd ms | bwd ms | fwd+bwd ms | fwd TFLOP/s | "
           "fwd+bwd TFLOP/s | fwd+bwd temporaries GiB |", "|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    name = r["variant"] + (f" (packed, M={r['documents_per_row']}, {r.get('rows_per_call') or 'all'} rows a call)"
                           if r.get("documents_per_row") else "")
    lines.append(f"| {name} | {r.get('batch', 1)} × {r['tokens']} | {r.get('most_documents_in_a_row') or '-'} | "
                 f"{r['tile'] or '-'} | {r['fwd_ms']:.1f} | "
                 f"{r['bwd_ms']:.1f} | {r['fwd_bwd_ms']:.1f} | {r['fwd_tflops']:.0f} | {r['fwd_bwd_tflops']:.0f} | "
                 f"{r.get('fwd_bwd_temp_gib', float('nan')):.2f} |")
  return "\n".join(lines)


def _key(row):
  """A row's name in the summary: cudnn_documents16 (M = 16, all rows a call), cudnn_documents16r1 (a row a call),
  cudnn_tiles4096 (tiles of 4096 rows where that is not the kernels' own)."""
  per_call = f"r{row['rows_per_call']}" if row.get("rows_per_call") else ""
  tile = row["tile"] if row.get("tile") not in (None, CUDNN_TILES.tile) else ""
  return f"{row['variant']}{row.get('documents_per_row') or ''}{per_call}{tile}"


def summary(rows):
  longest = max(r["tokens"] for r in rows)
  fields = " ".join(f"{_key(r)}_tflops={r['fwd_bwd_tflops']:.0f}" for r in rows if r["tokens"] == longest)
  return f"summary: cp_attention gpu={jax.devices()[0].device_kind.replace(' ', '_')} tokens={longest} {fields}"


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tokens", default="65536,262144")
  parser.add_argument("--variants", default="cudnn_whole,cudnn_tiles,xla_tiles")
  parser.add_argument("--tile", default=str(CUDNN_TILES.tile), help="cudnn_tiles' most rows of a tile, one row of "
                      "the table per value")
  parser.add_argument("--xla-max-tokens", type=int, default=65536)
  parser.add_argument("--iters", type=int, default=3)
  parser.add_argument("--batch", type=int, default=1, help="sequences (rows) of --tokens each")
  parser.add_argument("--mean-doc", type=int, default=0, help="packed documents of this mean length (0: one)")
  parser.add_argument("--documents-per-row", default=str(DOCUMENTS_PER_ROW),
                      help="cudnn_documents' bound M on a row's documents, one row of the table per value")
  parser.add_argument("--rows-per-call", default="auto",
                      help="cudnn_documents' rows per packed cuDNN call (0: all; auto: as the model), one row of the "
                           "table per value")
  parser.add_argument("--out", default=os.path.join(harness.RESULTS, "cp_attention.json"))
  args = parser.parse_args(argv)
  rows = []
  for tokens in (int(t) for t in args.tokens.split(",")):
    for variant in args.variants.split(","):
      if variant == "xla_tiles" and tokens > args.xla_max_tokens:
        continue
      packed = variant == "cudnn_documents"
      for tile in (args.tile.split(",") if variant == "cudnn_tiles" else [str(CUDNN_TILES.tile)]):
        for m in (args.documents_per_row.split(",") if packed else [DOCUMENTS_PER_ROW]):
          for per_call in (args.rows_per_call.split(",") if packed else ["0"]):
            if per_call == "auto":
              per_call = rows_per_call(
                  jax.ShapeDtypeStruct((args.batch, tokens, QUERY_HEADS, HEAD_DIM), jnp.bfloat16), int(m))
            rows.append(measure(variant, tokens, int(tile), args.iters, args.batch, args.mean_doc, int(m),
                                int(per_call) or None))
            print(rows[-1], flush=True)
  meta = dict(harness.machine(jax), command=harness.command_line("cp_attention", argv))
  text = f"# {meta['command']}\n# {json.dumps(meta)}\n\n{table(rows)}\n{summary(rows)}"
  harness.write_json(dict(meta=meta, rows=rows), args.out)
  print(harness.write_table(text, args.out))


if __name__ == "__main__":
  main()
