"""Communication volume and resident memory of the two ring modes (RelayMoE §3.2, Table 2), from static shapes.

No communication: this decides which ring `dispatcher="auto"` runs. Per device, with b bytes per element,
L = E/N local experts, w = 3·D·F·b / ETP (one gated expert's weights on one device; 2·D·F·b / ETP for a plain
two-matrix expert) and m = K·(4 + b) routing
metadata per token (an int32 token index and a router weight per pair):

                     per hop, forward              per hop, backward
  expert routing     L·w                           2·L·w (weights + relayed gradient, weights' dtype)
  token routing      T·(D·b + m) + 4E + 4·T·D      T·(2·D·b + m) + 4E + 4·T·D + 4·T·K
                     (tokens, plan, f32 output)    (tokens, output grad, plan, f32 dx and d(router weight))

T is the tokens on one device, already divided by sequence/context parallelism (the MoE block only sees those).
Shape letters: see relaymoe_jax.
"""

import dataclasses

import jax.numpy as jnp

from relaymoe_jax.errors import UserError

EXPERT_MODE, TOKEN_MODE = "ring_expert", "ring_token"


@dataclasses.dataclass(frozen=True)
class ModeVolume:
  """Bytes one device sends per hop, and holds at once, in forward and backward."""

  forward_bytes_per_hop: int
  backward_bytes_per_hop: int
  forward_resident_bytes: int
  backward_resident_bytes: int

  @property
  def bytes_per_hop(self):
    return self.forward_bytes_per_hop + self.backward_bytes_per_hop


@dataclasses.dataclass(frozen=True)
class DispatchPlan:
  """What `auto` chose and why: `mode` is the ring with fewer bytes per hop (forward + backward)."""

  mode: str
  expert_routing: ModeVolume
  token_routing: ModeVolume
  reason: str

  def as_dict(self):
    return dataclasses.asdict(self)


def _mib(volume):
  return f"{volume.bytes_per_hop / 2**20:.2f} MiB"


def plan_dispatch(*, tokens_per_device, d_model, d_ff, num_experts, top_k, ring_size, dtype="bfloat16",
                  expert_tensor_parallel=1, expert_matrices=3):
  """Both modes' volumes for one MoE layer on one device, and the mode with fewer bytes per hop. `expert_matrices`:
  3 for gated experts (gate, up, down), 2 for plain ones (`activations`)."""
  if num_experts % ring_size:
    raise UserError(f"E={num_experts} experts is not divisible by the ring size {ring_size}")
  b = jnp.dtype(dtype).itemsize
  t, d, k, e = tokens_per_device, d_model, top_k, num_experts
  local_weights = (e // ring_size) * expert_matrices * d * d_ff * b // expert_tensor_parallel  # L·w
  expert = ModeVolume(
      forward_bytes_per_hop=local_weights,
      backward_bytes_per_hop=2 * local_weights,
      forward_resident_bytes=t * d * (b + 4) + 2 * local_weights,  # tokens, f32 output, visiting + prefetched
      backward_resident_bytes=t * d * (2 * b + 4) + 4 * local_weights + local_weights * 4 // b,
  )
  metadata = k * (4 + b)
  token_fwd = t * (d * b + metadata) + 4 * e + 4 * t * d
  token_bwd = t * (2 * d * b + metadata) + 4 * e + 4 * t * d + 4 * t * k
  token = ModeVolume(
      forward_bytes_per_hop=token_fwd,
      backward_bytes_per_hop=token_bwd,
      forward_resident_bytes=local_weights + 2 * token_fwd + 4 * t * d,  # + the local f32 partial
      backward_resident_bytes=local_weights + local_weights * 4 // b + 2 * token_bwd + 4 * t * (d + k),
  )
  mode = EXPERT_MODE if expert.bytes_per_hop <= token.bytes_per_hop else TOKEN_MODE
  reason = (f"{mode}: {_mib(expert if mode == EXPERT_MODE else token)} per hop (forward + backward) against "
            f"{_mib(token if mode == EXPERT_MODE else expert)} for "
            f"{TOKEN_MODE if mode == EXPERT_MODE else EXPERT_MODE} (T={t}, D={d}, F={d_ff}, E={e}, K={k}, "
            f"N={ring_size}, ETP={expert_tensor_parallel}, {jnp.dtype(dtype).name})")
  return DispatchPlan(mode=mode, expert_routing=expert, token_routing=token, reason=reason)
