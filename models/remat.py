"""What a decoder layer's backward recomputes (`RuntimeConfig.remat`, per layer): the `jax.checkpoint` policies of
the layers that `nnx.remat` wraps whole (`layer`, `offload`, `all_but_attention`; `attention` wraps only attention and
`none` nothing).
"""

import jax

from models.attention.context_parallel import KERNEL_OUTPUTS
from models.attention.cudnn import keeps_kernel_outputs

LAYER_INPUT = "decoder_layer_input"  # checkpoint_name of the input that `offload` moves to the host


def remat_policy(policy):
  """`layer`: save nothing (the remat keeps only its inputs); `offload`: the layer input, named, goes to the host,
  so neither the remat nor a surrounding scan keeps it on the device; `all_but_attention`: save the attention
  kernel's output and softmax statistics (cuDNN's; an XLA attention's are its score matrices, recomputed)."""
  if policy == "all_but_attention":
    return jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.save_only_these_names(KERNEL_OUTPUTS), keeps_kernel_outputs)
  if policy == "offload":
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=[LAYER_INPUT], offload_src="device",
        offload_dst="pinned_host")
  return jax.checkpoint_policies.nothing_saveable
