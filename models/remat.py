"""What a decoder layer's backward recomputes (`RuntimeConfig.remat`, per layer): the `jax.checkpoint` policies of
the layers that `nnx.remat` wraps whole (`layer`, `all_but_attention`; `attention` wraps only attention and `none`
nothing), and `offloaded`, the whole-layer recompute whose input waits in host memory (`offload`).
"""

import jax
from flax import nnx

from models.attention.context_parallel import KERNEL_OUTPUTS
from models.attention.cudnn import keeps_kernel_outputs


def remat_policy(policy):
  """`layer`: save nothing (the remat keeps only its inputs); `all_but_attention`: save the attention kernel's output
  and softmax statistics (cuDNN's; an XLA attention's are its score matrices, recomputed)."""
  if policy == "all_but_attention":
    return jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.save_only_these_names(KERNEL_OUTPUTS), keeps_kernel_outputs)
  return jax.checkpoint_policies.nothing_saveable


def offloaded(forward, module, x, *inputs):
  """`forward(module, x, *inputs)` (an NNX module's pure forward, returning any pytree) whose backward recomputes it
  whole from `x` kept in host memory (`pinned_host`) instead of on the device.

  Written as a custom VJP rather than `save_and_offload_only_these_names` to fix when the copies happen: the
  forward's output passes on only once `x` is on the host, so the device copy of `x` can be freed while the next
  layers run; the backward fetches `x` only once the output's gradient exists, and passes the input's gradient on
  only with every weight gradient of the layer. With the policy XLA's schedule started the host copies in the
  backward pass and kept the inputs on the device until then (12 GiB at a million tokens for the Qwen3.5 slice).
  The residual is the host copy from before the barrier: XLA rejects a scan that stacks a barrier's host output.
  The backward is traced after the caller's context has closed, so the matmul precision asked for here is kept."""
  graphdef, state = nnx.split(module)
  precision = jax.config.jax_default_matmul_precision

  def run(state, x, inputs):
    with jax.default_matmul_precision(precision):
      return forward(nnx.merge(graphdef, state), x, *inputs)

  @jax.custom_vjp
  def layer(state, x, inputs):
    return run(state, x, inputs)

  def layer_forward(state, x, inputs):
    out = run(state, x, inputs)
    x_host = jax.device_put(x, jax.memory.Space.Host)
    out, _ = jax.lax.optimization_barrier((out, x_host))
    return out, (state, x_host, inputs)

  def layer_backward(residuals, d_out):
    state, x_host, inputs = residuals
    state, x_host, d_out = jax.lax.optimization_barrier((state, x_host, d_out))
    _, vjp = jax.vjp(run, state, jax.device_put(x_host, jax.memory.Space.Device), inputs)
    d_state, dx, d_inputs = vjp(d_out)
    d_state, dx = jax.lax.optimization_barrier((d_state, dx))
    return d_state, dx, d_inputs

  layer.defvjp(layer_forward, layer_backward)
  return layer(state, x, inputs)
