"""The JAX side of `benchmarks.capacity`: the machine, and the loss head's compiled temporaries.

    python -m benchmarks.capacity_worker [--config ep8] [--loss-head] [--topology 1x1x8 --target-config FILE]

Prints one JSON line: {"machine": …, "model": the run config's model} and, with --loss-head, "loss_head":
`loss_head` on this machine's first device, else (with --topology and no GPU here) compiled for one GPU of the
topology's kind.
"""

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from benchmarks import harness
from models.loss import chunked_cross_entropy, mean_cross_entropy
from train.config import load_run_config
from train.plan.search import topology_devices


def loss_head(tokens=65536, seq_len=4096, d_model=2048, vocab=151936, chunk_tokens=1024, vocab_tile=16384,
              device=None):
  """Compiled temporaries (GiB) of the loss head's fwd+bwd on one device (default this machine's first; or a
  compile-only device of `train.plan.search.topology_devices`): plain (full float32 logits), chunked per token
  (its backward recomputes the logits) and the trainer's mean with its gradient from the forward. Compile-only."""
  axes = ("data", "expert", "tensor")
  mesh = jax.sharding.Mesh(np.array([device or jax.devices()[0]]).reshape(1, 1, 1), axes)

  def spec(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P()))

  b = tokens // seq_len
  args = (spec((b, seq_len, d_model), jnp.bfloat16), spec((d_model, vocab), jnp.float32),
          spec((b, seq_len), jnp.int32))

  def plain(x_BSD, head_DV, labels_BS):
    logits_BSV = jnp.dot(x_BSD, head_DV.astype(x_BSD.dtype), preferred_element_type=jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits_BSV, labels_BS)

  def chunked(x_BSD, head_DV, labels_BS):
    return chunked_cross_entropy(x_BSD, head_DV, labels_BS, mesh=mesh, token_axes=axes[:2], vocab_axis="tensor",
                                 chunk_tokens=chunk_tokens, vocab_tile=vocab_tile)

  def forward_grad(x_BSD, head_DV, labels_BS):  # already the mean
    return mean_cross_entropy(x_BSD, head_DV, labels_BS, mesh=mesh, token_axes=axes[:2], vocab_axis="tensor",
                              chunk_tokens=chunk_tokens, vocab_tile=vocab_tile)

  def temps(loss, mean=jnp.mean):
    def mean_loss(x_BSD, head_DV, labels_BS):
      return mean(loss(x_BSD, head_DV, labels_BS))

    step = jax.jit(jax.value_and_grad(mean_loss, (0, 1)))
    return step.lower(*args).compile().memory_analysis().temp_size_in_bytes / 2**30

  return dict(tokens=tokens, d_model=d_model, vocab=vocab, chunk_tokens=chunk_tokens, vocab_tile=vocab_tile,
              plain_temp_gib=temps(plain), chunked_temp_gib=temps(chunked),
              forward_grad_temp_gib=temps(forward_grad, mean=lambda loss: loss),
              full_logits_gib=tokens * vocab * 4 / 2**30)


def loss_head_here(topology=None, target_config=None):
  """loss_head on this machine's GPU, else (with `topology`) compiled for one GPU of the topology's kind."""
  if not topology or jax.default_backend() == "gpu":
    return dict(loss_head(), device_kind=jax.devices()[0].device_kind)
  device = topology_devices("1x1x1", target_config)[0]
  env = " ".join(f"{k}={os.environ[k]}" for k in ("JAX_PLATFORMS", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "XLA_FLAGS")
                 if k in os.environ)
  return dict(loss_head(device=device), device_kind=device.device_kind,
              how=f"compiled for one without it (--target-config {target_config}; {env}), JAX {jax.__version__}")


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="ep8")
  parser.add_argument("--loss-head", action="store_true")
  parser.add_argument("--topology")
  parser.add_argument("--target-config")
  args = parser.parse_args(argv)
  result = dict(machine=harness.machine(jax), model=load_run_config(args.config).model)
  if args.loss_head:
    result["loss_head"] = loss_head_here(args.topology, args.target_config)
  print(json.dumps(result), flush=True)


if __name__ == "__main__":
  main()
