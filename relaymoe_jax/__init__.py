"""RelayMoE in JAX: ring-based expert-parallel MoE layers with gradient relay.

Shape letters, one legend for the whole project (a name ends in its array's dims, x_TD is [T, D]; other modules
point here):
  B     batch
  S     sequence positions
  T     tokens (on this device inside shard_map)
  D     model width
  F     an FFN's width (an expert's, the dense MLP's, the shared expert's)
  U     an expert's input-projection width: fused gate|up (2F) for gated activations, F for plain ones
  E     experts (global)
  L     experts per ring partition (also the groups of a grouped matmul)
  K     top-k
  P     token–expert pairs (T·K)
  R     rows of one chunk (a hop's pairs; the loss head's positions)
  N     ring size
  M     rows of a grouped-matmul operand
  I / O a grouped matmul's contraction (input) and output widths
  C     slots per destination (all-to-all)
  V     vocabulary
  H     attention width (query heads × head_dim)
  G     key/value width (kv heads × head_dim)
  Q     query heads
  J     key/value heads
  Z     head_dim
  Y     MoE layers (a model's, in order)
  A     micro-batches of one training step (gradient accumulation)
  In Qwen3.5's Gated DeltaNet (`models.qwen35`): C its conv channels ([q | k | v]), Q its value heads, X a head's
  width, W the conv window; in spans of the sequence (`models.spans`) N a row's chunks, T a span's positions, P
  spans; inside the gated delta rule (`models.attention.gated_delta*`, its own legend) H value
  heads, G key heads, R value heads per key head, K / V a head's key / value width, C chunk positions, N chunks,
  J one block's columns of V, M matrices and X any leading dims.

    y, aux = rm.nnx.MoE(d_model, num_experts=E, top_k=K, d_ff=F, mesh=mesh, rngs=rngs)(x_BSD)  # or rm.linen.MoE
    idx_TK, w_TK, aux = route(x_TD, router_DE, top_k=K)
    y_TD = moe_ffn(x_TD, idx_TK, w_TK, w_gate_EDF, w_up_EDF, w_down_EFD, mesh=mesh, dispatcher="ring_expert")
    step = jax.jit(loss_and_grads, compiler_options=COMPILER_OPTIONS)  # the rings' sends overlap compute on GPUs

Checks for your own tests, against the dense oracle: `import relaymoe_jax.testing` (not imported here).
"""

import importlib

from relaymoe_jax.all_to_all import AllToAll
from relaymoe_jax.ring.auto import Auto
from relaymoe_jax.axes import DATA, EXPERT, TENSOR
from relaymoe_jax.balance import expert_load_stats, update_router_bias
from relaymoe_jax.layers.block import MoEAux
from relaymoe_jax.compiler import COMPILER_OPTIONS, compiled_bytes
from relaymoe_jax.dense import Dense, dense_moe
from relaymoe_jax.layout import ExpertLayout
from relaymoe_jax.moe import DISPATCHERS, DispatchStats, dense_swiglu, make_dispatcher, moe_ffn, shared_expert
from relaymoe_jax.ring.expert import RingExpert
from relaymoe_jax.ring.token import RingToken
from relaymoe_jax.routing import RouterAux, load_balancing_loss, route
from relaymoe_jax.ring.volume import DispatchPlan, ModeVolume, plan_dispatch

__all__ = [
    "AllToAll", "Auto", "COMPILER_OPTIONS", "DATA", "DISPATCHERS", "Dense", "DispatchPlan", "DispatchStats", "EXPERT",
    "ExpertLayout", "MoEAux", "ModeVolume", "RingExpert", "RingToken", "RouterAux", "TENSOR", "compiled_bytes",
    "dense_moe", "dense_swiglu", "expert_load_stats", "linen", "load_balancing_loss", "make_dispatcher", "moe_ffn",
    "nnx", "plan_dispatch", "route", "shared_expert", "update_router_bias",
]
_LAYERS = ("linen", "nnx")  # Flax layers, imported on first use so the functional API never loads Flax


def __getattr__(name):
  if name in _LAYERS:
    return importlib.import_module(f"relaymoe_jax.layers.{name}")
  raise AttributeError(f"module 'relaymoe_jax' has no attribute {name!r}")
