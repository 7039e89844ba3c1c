"""`dispatcher="auto"`: the ring mode with fewer bytes per hop, chosen at trace time from static shapes.

Moves what the chosen ring moves (see `ring_expert`, `ring_token`); `volume.plan_dispatch` makes the choice.
"""

import dataclasses

from relaymoe_jax.ring.expert import RingExpert
from relaymoe_jax.ring.token import RingToken
from relaymoe_jax.ring.volume import EXPERT_MODE, plan_dispatch


def plan_for(layout, x_TD, idx_TK, w_gate_EDF, gated=True):
  _, d_model, d_ff = w_gate_EDF.shape
  num_experts = layout.num_experts(w_gate_EDF)
  return plan_dispatch(tokens_per_device=x_TD.shape[0] // layout.token_shards, d_model=d_model, d_ff=d_ff,
                       num_experts=num_experts, top_k=idx_TK.shape[1], ring_size=layout.ring_size,
                       dtype=w_gate_EDF.dtype, expert_tensor_parallel=layout.tensor_size,
                       expert_matrices=3 if gated else 2)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Auto:
  """Runs `RingExpert` or `RingToken`, whichever `plan_dispatch` says moves fewer bytes per hop.

  Attributes:
    chunk_rows, max_chunk_rows: passed to the chosen ring.
    backend: grouped-matmul backend name.
    keep_gate_up: passed to `RingExpert` where it is chosen (`RingToken` keeps nothing).
  """

  chunk_rows: int | tuple[int, ...] | None = None
  max_chunk_rows: int | None = None
  backend: str = "auto"
  keep_gate_up: bool = False

  def __call__(self, x_TD, idx_TK, w_TK, w_gate_EDF, w_up_EDF, w_down_EFD, *, layout, activation="swiglu"):
    options = dict(chunk_rows=self.chunk_rows, max_chunk_rows=self.max_chunk_rows, backend=self.backend)
    if plan_for(layout, x_TD, idx_TK, w_gate_EDF, w_up_EDF is not None).mode == EXPERT_MODE:
      ring = RingExpert(**options, keep_gate_up=self.keep_gate_up)
    else:
      ring = RingToken(**options)
    return ring(x_TD, idx_TK, w_TK, w_gate_EDF, w_up_EDF, w_down_EFD, layout=layout, activation=activation)
