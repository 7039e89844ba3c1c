"""A minimal Flax Linen decoder with `rm.linen.MoE` as its MLP, trained a few steps on a 2 data × 4 expert mesh.

Run: `python examples/linen_decoder.py` (on 8 emulated CPU devices where there is no GPU). Shape letters: see
relaymoe_jax.
"""

import os

# Before JAX starts. Only the CPU platform reads the device count, so GPUs are used as they are. NPROC sizes XLA:CPU's
# thread pool: emulated devices share it, and two programs with collectives in flight can otherwise deadlock it.
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("NPROC", "256")

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import relaymoe_jax as rm

VOCAB, D, HEADS, LAYERS = 32, 16, 2, 2
RULES = (("batch", "data"), ("embed", None), ("mlp", None))  # this model's own logical axis rules


class Block(nn.Module):
  mesh: jax.sharding.Mesh

  @nn.compact
  def __call__(self, x_BSD):
    mask = nn.make_causal_mask(jnp.ones(x_BSD.shape[:2]))
    x_BSD = x_BSD + nn.MultiHeadDotProductAttention(num_heads=HEADS, deterministic=True)(nn.RMSNorm()(x_BSD),
                                                                                        mask=mask)
    y_BSD, aux = rm.linen.MoE(num_experts=8, top_k=2, d_ff=32, mesh=self.mesh)(nn.RMSNorm()(x_BSD))
    return x_BSD + y_BSD, aux.router.load_balancing_loss


class Decoder(nn.Module):
  mesh: jax.sharding.Mesh

  @nn.compact
  def __call__(self, tokens_BS):
    x_BSD = nn.Embed(VOCAB, D)(tokens_BS)
    scan = nn.scan(nn.remat(Block), variable_axes={"params": 0}, split_rngs={"params": True}, length=LAYERS,
                   metadata_params={nn.PARTITION_NAME: None})
    x_BSD, lb_L = scan(self.mesh)(x_BSD)
    return nn.Dense(VOCAB)(nn.RMSNorm()(x_BSD)), jnp.mean(lb_L)


def train(steps=5, seed=0):
  """Trains on sequences that count up mod VOCAB; returns the losses."""
  mesh = jax.make_mesh((2, 4), ("data", "expert"))
  model = Decoder(mesh)
  start = np.random.default_rng(seed).integers(0, VOCAB, size=(8, 1))
  tokens_BS = jnp.asarray((start + np.arange(9)) % VOCAB, jnp.int32)
  with jax.set_mesh(mesh):
    # Shardings as a logical-rules model gets them (lm1b, MaxText): the MoE layer's parameters name mesh axes, kept
    # only where the rules map each name to itself, which `rm.linen.axis_rules()` adds.
    specs = nn.get_partition_spec(jax.eval_shape(model.init, jax.random.key(seed), tokens_BS[:, :-1]))
    shardings = nn.logical_to_mesh_sharding(specs, mesh, RULES + rm.linen.axis_rules())
    params = jax.jit(model.init, out_shardings=shardings)(jax.random.key(seed), tokens_BS[:, :-1])["params"]
    opt = optax.adam(1e-2)
    opt_state = opt.init(params)

    def loss_fn(params, tokens_BS):
      logits_BSV, lb = model.apply({"params": params}, tokens_BS[:, :-1])
      return optax.softmax_cross_entropy_with_integer_labels(logits_BSV, tokens_BS[:, 1:]).mean() + 0.01 * lb

    @jax.jit
    def step(params, opt_state, tokens_BS):
      loss, grads = jax.value_and_grad(loss_fn)(params, tokens_BS)
      updates, opt_state = opt.update(grads, opt_state)
      return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for _ in range(steps):
      params, opt_state, loss = step(params, opt_state, tokens_BS)
      losses.append(float(loss))
  return losses


if __name__ == "__main__":
  print(train(steps=20))
