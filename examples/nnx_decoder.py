"""A minimal Flax NNX decoder with `rm.nnx.MoE` as its MLP, trained a few steps on a 2 data × 4 expert mesh.

Run: `python examples/nnx_decoder.py` (on 8 emulated CPU devices where there is no GPU). Shape letters: see
relaymoe_jax.
"""

import os

# Before JAX starts. Only the CPU platform reads the device count, so GPUs are used as they are. NPROC sizes XLA:CPU's
# thread pool: emulated devices share it, and two programs with collectives in flight can otherwise deadlock it.
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("NPROC", "256")

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import relaymoe_jax as rm

VOCAB, D, HEADS, LAYERS = 32, 16, 2, 2


class Block(nnx.Module):

  def __init__(self, mesh, rngs):
    self.norm1, self.norm2 = nnx.RMSNorm(D, rngs=rngs), nnx.RMSNorm(D, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(HEADS, D, decode=False, rngs=rngs)
    self.moe = rm.nnx.MoE(D, num_experts=8, top_k=2, d_ff=32, mesh=mesh, rngs=rngs)

  def __call__(self, x_BSD):
    mask = nnx.make_causal_mask(jnp.ones(x_BSD.shape[:2]))
    x_BSD = x_BSD + self.attn(self.norm1(x_BSD), mask=mask)
    y_BSD, aux = self.moe(self.norm2(x_BSD))
    return x_BSD + y_BSD, aux.router.load_balancing_loss


class Decoder(nnx.Module):

  def __init__(self, mesh, rngs):
    self.embed = nnx.Embed(VOCAB, D, rngs=rngs)

    @nnx.split_rngs(splits=LAYERS)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
    def blocks(rngs):
      return Block(mesh, rngs)

    self.blocks = blocks(rngs)
    self.norm = nnx.RMSNorm(D, rngs=rngs)
    self.head = nnx.Linear(D, VOCAB, rngs=rngs)

  def __call__(self, tokens_BS):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
    @nnx.remat
    def run(x_BSD, block):
      return block(x_BSD)

    x_BSD, lb_L = run(self.embed(tokens_BS), self.blocks)
    return self.head(self.norm(x_BSD)), jnp.mean(lb_L)


def train(steps=5, seed=0):
  """Trains on sequences that count up mod VOCAB; returns the losses."""
  mesh = jax.make_mesh((2, 4), ("data", "expert"))
  start = np.random.default_rng(seed).integers(0, VOCAB, size=(8, 1))
  tokens_BS = jnp.asarray((start + np.arange(9)) % VOCAB, jnp.int32)
  with jax.set_mesh(mesh):
    model = Decoder(mesh, nnx.Rngs(seed))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    def loss_fn(model, tokens_BS):
      logits_BSV, lb = model(tokens_BS[:, :-1])
      return optax.softmax_cross_entropy_with_integer_labels(logits_BSV, tokens_BS[:, 1:]).mean() + 0.01 * lb

    @nnx.jit
    def step(model, optimizer, tokens_BS):
      loss, grads = nnx.value_and_grad(loss_fn)(model, tokens_BS)
      optimizer.update(model, grads)
      return loss

    return [float(step(model, optimizer, tokens_BS)) for _ in range(steps)]


if __name__ == "__main__":
  print(train(steps=20))
