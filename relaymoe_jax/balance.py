"""Expert load: how evenly the router spreads token–expert pairs (statistics for logs), and auxiliary-loss-free
balancing's bias update (DeepSeek-V3, arXiv:2412.19437 §2.1.2). Shape letters: see relaymoe_jax."""

import jax.numpy as jnp


def expert_load_stats(counts_E):
  """Load statistics of pair counts per expert (`RouterAux.expert_counts_E`, or [..., E] for several layers at
  once), each over the last axis, float32 (int32 for `dead`):

    max_over_mean: the busiest expert's pairs over the mean (1 when balanced; E / K when every token picks the
      same K experts);
    min_over_mean: the idlest expert's over the mean;
    cv: coefficient of variation, the population standard deviation over the mean;
    dead: experts that got no pair.

  Zero pairs give ratios and cv of 0, not NaN."""
  counts = counts_E.astype(jnp.float32)
  mean = jnp.mean(counts, axis=-1)
  safe = jnp.where(mean > 0, mean, 1.0)
  return dict(max_over_mean=jnp.max(counts, axis=-1) / safe, min_over_mean=jnp.min(counts, axis=-1) / safe,
              cv=jnp.std(counts, axis=-1) / safe, dead=jnp.sum(counts_E == 0, axis=-1, dtype=jnp.int32))


def update_router_bias(bias_E, counts_E, rate):
  """The bias after one step of auxiliary-loss-free balancing: bias + rate · sign(mean load − load), so an
  overloaded expert's bias falls and an idle one's rises (DeepSeek-V3's update). `counts_E`: the step's pairs per
  expert ([..., E] for several layers); the bias keeps its dtype."""
  counts = counts_E.astype(jnp.float32)
  error = jnp.mean(counts, axis=-1, keepdims=True) - counts
  return (bias_E + rate * jnp.sign(error)).astype(bias_E.dtype)
