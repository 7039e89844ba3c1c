"""cuDNN flash attention as the tile kernels of context parallelism, and the choice between it and XLA's.

A shard's (query tile, key tile) pairs are merged by their row logsumexp, and each pair's backward must see the
output and logsumexp of the whole row. JAX's public `jax.nn.dot_product_attention` gives neither: it rounds the
logsumexp to the output's dtype and its gradient drops the logsumexp's cotangent. So the forward calls JAX's cuDNN
wrapper (`jax._src.cudnn.fused_attention_stablehlo.dot_product_attention`, which returns the float32 logsumexp)
and the backward binds its backward primitive with the row's output and logsumexp in place of the pair's own.
Both are JAX internals: `tile_kernels("auto", ...)` falls back to XLA's tiles, with a warning, where they are
missing or cuDNN is. A pair of packed documents' tiles takes its segment mask as an additive bias [B, 1, A, W] in
the compute dtype (a masked score is the dtype's large negative number, so a row that sees none of the pair's keys
gets a logsumexp the merge weighs 0): computed, not skipped, within a pair.

Shape letters: see `relaymoe_jax`; A and W the rows of a query and a key tile.
"""

import contextlib
import functools
import logging

import jax.numpy as jnp

from models.attention.context_parallel import XLA_TILES, TileKernels
from relaymoe_jax.errors import UserError

try:
  from jax._src.cudnn import fused_attention_stablehlo as jax_cudnn
except ImportError:  # a JAX without its cuDNN attention module
  jax_cudnn = None

TILE = 16384  # rows of a tile pair: large enough that a pair runs at the kernel's full speed


def _mask(causal):
  return jax_cudnn.MaskType.CAUSAL if causal else jax_cudnn.MaskType.NO_MASK


def _bias(mask_BAW, dtype):
  return None if mask_BAW is None else jax_cudnn.combine_bias_and_mask(None, mask_BAW[:, None], dtype)


def _forward(q_BAQZ, k_BWJZ, v_BWJZ, *, causal, scale, mask_BAW=None):
  o_BAQZ, lse_BQA = jax_cudnn.dot_product_attention(q_BAQZ, k_BWJZ, v_BWJZ, _bias(mask_BAW, q_BAQZ.dtype),
                                                    scale=scale, mask_type=_mask(causal), qkv_layout="BTNH",
                                                    return_residual=True)
  return o_BAQZ, lse_BQA


def _backward(q_BAQZ, k_BWJZ, v_BWJZ, o_BAQZ, lse_BQA, do_BAQZ, *, causal, scale, mask_BAW=None):
  unused = jnp.zeros(0, q_BAQZ.dtype)  # no sequence lengths, offsets or page tables (nor a bias unless masked)
  bias = _bias(mask_BAW, q_BAQZ.dtype)
  grads = jax_cudnn._dot_product_attention_bwd_p_wrapper.bind(
      q_BAQZ, k_BWJZ, v_BWJZ, unused if bias is None else bias, unused, unused, unused, unused, unused, unused,
      lse_BQA, o_BAQZ.astype(q_BAQZ.dtype), do_BAQZ.astype(q_BAQZ.dtype), scale=scale, seed=0, dropout_rate=0.0,
      variadic_args=(bias is not None, False), mask_type=_mask(causal), layout=jax_cudnn.AttentionLayout.BTNH.value,
      sliding_window_length=None)
  return tuple(grads[:3])


CUDNN_TILES = TileKernels(name="cudnn", forward=_forward, backward=_backward, tile=TILE)


def keeps_kernel_outputs(prim, *_, **__):
  """A remat policy: save what cuDNN's attention forward returns, the output and its softmax statistics (inside
  `jax.nn.dot_product_attention`, whose residuals cannot be named as `KERNEL_OUTPUTS`)."""
  return jax_cudnn is not None and prim is getattr(jax_cudnn, "_dot_product_attention_fwd_p_wrapper", None)


@contextlib.contextmanager
def checks_see(device):
  """While inside, JAX's cuDNN checks (the head width, the packed layout: Hopper or later?) read the compute
  capability of `device`, a compile-only GPU of another host (`train.plan.search.topology_devices`), instead of this
  host's own GPU, which a CPU host has none of; outside a GPU's or without JAX's checks, nothing changes."""
  capability = getattr(device, "compute_capability", None)
  if jax_cudnn is None or capability is None or not hasattr(jax_cudnn, "check_compute_capability"):
    yield
    return
  target = tuple(int(x) for x in str(capability).split("."))
  version = lambda c: tuple(int(x) for x in c.split("."))
  checks = {"check_compute_capability": lambda c: target >= version(c),
            "is_cuda_compute_capability_equal": lambda c: target == version(c)}
  own = {name: getattr(jax_cudnn, name) for name in checks if hasattr(jax_cudnn, name)}
  for name in own:
    setattr(jax_cudnn, name, checks[name])
  try:
    yield
  finally:
    for name, check in own.items():
      setattr(jax_cudnn, name, check)


def max_head_dim():
  """The widest head JAX's cuDNN check lets through: 256 where it sees a Hopper or later GPU among this process's
  devices (or the target's, inside `checks_see`), else 128."""
  hopper = getattr(jax_cudnn, "check_compute_capability", None)
  return 256 if hopper is not None and hopper("9.0") else 128


def unavailable(platform, dtype, head_dim=None):
  """Why cuDNN tiles cannot attend here, or None; `head_dim` checked against JAX's limits where given."""
  if platform != "gpu":
    return f"the devices are {platform}, not GPUs"
  if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
    return f"cuDNN flash attention takes bfloat16 or float16, not {jnp.dtype(dtype).name}"
  if jax_cudnn is None or not hasattr(jax_cudnn, "_dot_product_attention_bwd_p_wrapper"):
    return "this JAX has no cuDNN attention primitives"
  if head_dim is not None and (head_dim % 8 or head_dim > max_head_dim()):
    return f"cuDNN flash attention here takes heads of at most {max_head_dim()}, a multiple of 8, not {head_dim}"
  try:
    jax_cudnn.check_cudnn_version()
  except RuntimeError as err:
    return str(err)
  return None


def tile_kernels(implementation, platform, dtype, head_dim=None):
  """The `TileKernels` for `runtime.attention_implementation` ('auto', 'xla' or 'cudnn') on `platform`, for heads of
  `head_dim` (None: not checked)."""
  if implementation == "xla":
    return XLA_TILES
  reason = unavailable(platform, dtype, head_dim)
  if reason is None:
    return CUDNN_TILES
  if implementation == "cudnn":
    raise UserError(f"attention_implementation='cudnn' under context parallelism: {reason}")
  if platform == "gpu":
    _log_fallback(reason)
  return XLA_TILES


@functools.lru_cache(maxsize=None)
def _log_fallback(reason):
  logging.getLogger(__name__).warning("context-parallel attention uses XLA's tiles: %s", reason)
