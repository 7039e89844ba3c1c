"""The JAX side of `benchmarks.moe_layer`: compiles and measures one variant in this process.

    python -m benchmarks.moe_layer_worker --one VARIANT --shape SHAPE --tokens T [--iters N] [--profile DIR]
                                          [--xla-option KEY=VALUE ...]
    python -m benchmarks.moe_layer_worker --describe [--shape A,B] [--xla-option KEY=VALUE ...]

`--one` is a variant process of `benchmarks.moe_layer`'s driver (`harness.Child`): it compiles, says so on
stdout, waits for a line on stdin, measures, and prints its row as JSON. `--describe` prints the machine, the
compiler options and each shape's (D, F, E, K), failing on an unknown shape.
"""

import argparse
import contextlib
import functools
import json
import os
import time
import unittest.mock

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import relaymoe_jax as rm
from benchmarks import harness
from benchmarks.moe_layer import MODEL_OF_SHAPE, TRANSFER, stack_depth, variant_options
from benchmarks.trace_summary import find_trace, kernel_times
from models.qwen3.config import load_config
from relaymoe_jax import gate_up
from relaymoe_jax.ring.schedule import ring_pass, ring_relay, ring_relay_homeward

PROFILE_STEPS = 2


def layer_shape(name):
  """(D, F, E, K) of one MoE layer of a model config (`qwen3_30b`, `grid-e64-k8-f768`, `tiny`, …; `NAME*L`: L
  such layers)."""
  name = name.partition("*")[0]
  c = load_config(MODEL_OF_SHAPE.get(name, name))
  return c.hidden_size, c.moe_intermediate_size, c.num_experts, c.num_experts_per_tok


def expert_flops(tokens, d, f, k):
  """Useful fwd+bwd FLOPs of the experts: 3 × (gate+up 2·D·U + down 2·F·D) per token–expert pair, U = 2F."""
  return 3 * tokens * k * (2 * d * 2 * f + 2 * f * d)


def compiler_options(xla_options=()):
  """The library's `rm.COMPILER_OPTIONS` with `KEY=VALUE` overrides (true/false and integers parsed)."""
  return dict(rm.COMPILER_OPTIONS, **harness.parse_options(xla_options))


def _keep_local(x, axis_name, perm):
  del axis_name, perm  # ppermute's signature
  return x


def _corner(arrays):
  return sum(a[0, 0, 0].astype(jnp.float32) for a in arrays)


def _touch(state, partition, payload):
  del partition
  return state + _corner(payload)


def _partial(state, partition, payload):
  return _touch(state, partition, payload), tuple(0.5 * a.astype(jnp.float32) for a in payload)


def _cast(arrays, dtype):
  return tuple(a.astype(dtype) for a in arrays)


def _transfer_step(mesh, layers):
  """A jitted step that moves exactly what ring_expert moves by default (forward `ring_pass` of the fused weights,
  backward `ring_relay` of weights and their gradients, homeward where the ring reverses its backward), with only
  a trivial add per hop. Every array of a payload and of an accumulator is read at the end and a hop's partial is a
  scaled copy, so XLA can drop no send: reading only w_down, an earlier version moved a third of the bytes (its
  compiled HLO had w_down's sends alone)."""
  n = mesh.shape[rm.EXPERT]
  reverse = rm.RingExpert().reverses_backward(n)

  def per_device(*weights):
    state = jnp.zeros((), jnp.float32)
    for layer in range(layers):
      w_gate_LDF, w_up_LDF, w_down_LFD = weights[3 * layer:3 * layer + 3]
      own = (gate_up.join(w_gate_LDF, w_up_LDF), w_down_LFD)
      to_relay = functools.partial(_cast, dtype=w_down_LFD.dtype)
      state, last = ring_pass(_touch, state, own, axis=rm.EXPERT, n=n)
      if reverse:
        state, acc = ring_relay_homeward(_partial, state, last, home=own, axis=rm.EXPERT, n=n, to_relay=to_relay)
      else:
        state, acc = ring_relay(_partial, state, own, axis=rm.EXPERT, n=n, to_relay=to_relay)
      state = state + _corner(acc)
    return state[None]

  spec = P(rm.EXPERT)
  return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(spec,) * 3 * layers, out_specs=spec,
                               check_vma=False))


def _inputs(mesh, shape, tokens_per_gpu):
  """The same tokens, routing and expert weights for every variant (key 0), sharded over the expert axis."""
  d, f, e, k = layer_shape(shape)
  t = tokens_per_gpu * mesh.size
  keys = jax.random.split(jax.random.key(0), 2 + 3 * stack_depth(shape))
  sharded = NamedSharding(mesh, P(rm.EXPERT))
  bf16 = jnp.bfloat16
  # Each array made in place, sharded: a whole array made on the first GPU and then split would stay in that
  # process's allocator pool (it does not give memory back), on one GPU only.
  on_mesh = functools.partial(jax.jit, out_shardings=sharded)

  def weight(key, shape_):
    return (jax.random.normal(key, shape_, jnp.float32) / np.sqrt(shape_[1])).astype(bf16)

  def route(x_TD, router_DE):
    return rm.route(x_TD, router_DE, top_k=k)

  x_TD = on_mesh(functools.partial(jax.random.normal, keys[0], (t, d), bf16))()
  router_DE = jax.random.normal(keys[1], (d, e), bf16) * 0.02
  idx_TK, w_TK, _ = jax.jit(route, out_shardings=(sharded, sharded, None))(x_TD, router_DE)
  weights = [on_mesh(functools.partial(weight, key, s))()
             for key, s in zip(keys[2:], ((e, d, f), (e, d, f), (e, f, d)) * stack_depth(shape))]
  return x_TD, idx_TK, w_TK, weights


def _step(mesh, variant, layers):
  """The jitted fwd+bwd step of one variant, taking (x, router weights, (w_gate, w_up, w_down) per layer, expert
  indices); the layers share the routing and chain through the residual, h ← h + y."""
  dispatcher, options = variant_options(variant)

  def loss(x_TD, w_TK, *weights_and_idx):
    *weights, idx_TK = weights_and_idx
    h_TD = x_TD
    for layer in range(layers):
      y_TD = rm.moe_ffn(h_TD, idx_TK, w_TK, *weights[3 * layer:3 * layer + 3], mesh=mesh, dispatcher=dispatcher,
                        **options)
      h_TD = h_TD + y_TD
    return jnp.sum(y_TD.astype(jnp.float32) ** 2)

  return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(2 + 3 * layers))))


def _transfer_args(x, idx, w, weights):
  del x, idx, w
  return tuple(weights)


def _step_args(x, idx, w, weights):
  return (x, w, *weights, idx)


def compile_variant(variant, shape, tokens_per_gpu, xla_options=(), gpus=None):
  """(compiled fwd+bwd step, a function making its arguments afresh, the devices) of one variant, compiled with
  `compiler_options(xla_options)`, on the first `gpus` devices (default all)."""
  devices = jax.devices()[:1] if variant.startswith("compute_floor") else jax.devices()[:gpus]
  mesh = jax.sharding.Mesh(np.array(devices), (rm.EXPERT,))
  layers = stack_depth(shape)
  if variant == TRANSFER:
    step, pick = _transfer_step(mesh, layers), _transfer_args
  else:
    step, pick = _step(mesh, variant, layers), _step_args

  def make_args():
    return pick(*_inputs(mesh, shape, tokens_per_gpu))

  no_sends = unittest.mock.patch("jax.lax.ppermute", _keep_local) if variant.startswith("ring_nocomm") else \
      contextlib.nullcontext()
  # Lowered from shapes alone, so a process waiting for its turn to measure holds no device memory. `_inputs`
  # splits every input over the expert axis on its first dimension (eval_shape does not keep shardings).
  sharded = NamedSharding(mesh, P(rm.EXPERT))
  abstract_args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharded) for a in jax.eval_shape(make_args)]
  with no_sends:
    return step.lower(*abstract_args).compile(compiler_options(xla_options)), make_args, devices


def run_one(variant, shape, tokens_per_gpu, iters, profile_dir=None, compiled_hook=None, xla_options=()):
  """Measures one variant in this process; returns a dict (or the failure). `compiled_hook(row)` runs between
  compiling and measuring, with no input left on the device. With `profile_dir`, then traces PROFILE_STEPS more
  steps there and adds the first device's kernel time by kind (`benchmarks.trace_summary`)."""
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
    row["kernels"] = _profile(compiled, args, os.path.join(profile_dir, variant.replace("/", "_")))
  return row


def does_not_fit(compiled, devices, row):
  """Whether the compiled step needs more than a device's allocator can give (then `row` says so, with both
  numbers): such a step is not run, because one GPU failing its allocation leaves the other GPU's half of the
  step waiting in a send that never completes, and the process hangs."""
  limit = min((dev.memory_stats() or {}).get("bytes_limit", 0) for dev in devices)
  needed = rm.compiled_bytes(compiled)
  if not limit or needed <= limit:
    return False
  row.update(error="out of memory", needed_bytes=needed, limit_bytes=int(limit))
  return True


def _profile(compiled, args, trace_dir):
  with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
    for _ in range(PROFILE_STEPS):
      out = compiled(*args)
    jax.block_until_ready(out)
  platform_device = "GPU:0" if jax.default_backend() == "gpu" else "CPU"
  return kernel_times(find_trace(trace_dir), PROFILE_STEPS, platform_device)


def describe(shapes=(), xla_options=()):
  """The machine, the compiler options and {shape: (D, F, E, K)}: an unknown shape fails here, listing the known
  ones."""
  return dict(machine=harness.machine(jax), compiler_options=compiler_options(xla_options),
              shapes={name: layer_shape(name) for name in shapes})


def _report_compiled(row):
  harness.wait_for_turn(dict(compile_s=row["compile_s"]))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  what = parser.add_mutually_exclusive_group(required=True)
  what.add_argument("--one", metavar="VARIANT", help="compile, wait for a line on stdin, measure, print the row")
  what.add_argument("--describe", action="store_true")
  parser.add_argument("--shape", default="")
  parser.add_argument("--tokens", type=int)
  parser.add_argument("--iters", type=int, default=5)
  parser.add_argument("--profile", metavar="DIR")
  parser.add_argument("--xla-option", action="append", default=[], metavar="KEY=VALUE")
  args = parser.parse_args(argv)
  if args.describe:
    result = describe([s for s in args.shape.split(",") if s], args.xla_option)
  else:
    result = run_one(args.one, args.shape, args.tokens, args.iters, args.profile, _report_compiled, args.xla_option)
  print(json.dumps(result), flush=True)


if __name__ == "__main__":
  main()
