"""The volume model against hand-computed bytes, and `auto` choosing (and computing) the right ring."""

import jax.numpy as jnp
import pytest

import relaymoe_jax as rm
from conftest import mesh_of, random_layer
from test_equivalence import DATA_EXPERT, E_ONLY, F32_RTOL, assert_matches_oracle


def test_bytes_match_hand_computation_bf16():
  # T=4096, D=1024, F=512, E=64, K=4, N=8, bf16: L=8, W=3·1024·512·2=3 145 728, M=4·(4+2)=24.
  plan = rm.plan_dispatch(tokens_per_device=4096, d_model=1024, d_ff=512, num_experts=64, top_k=4, ring_size=8)
  assert plan.expert_routing.forward_bytes_per_hop == 8 * 3_145_728
  assert plan.expert_routing.backward_bytes_per_hop == 2 * 8 * 3_145_728
  assert plan.token_routing.forward_bytes_per_hop == 4096 * (2048 + 24) + 4 * 64 + 4 * 4096 * 1024
  assert plan.token_routing.backward_bytes_per_hop == 4096 * (4096 + 24) + 4 * 64 + 4 * 4096 * 1024 + 4 * 4096 * 4
  assert plan.mode == "ring_token"  # 58.98 MB against 75.50 MB per hop


def test_two_matrix_experts_send_two_thirds_of_the_weights():
  """Plain experts (activation gelu or relu: no up matrix): W = 2·D·F·b, which turns the choice above around."""
  plan = rm.plan_dispatch(tokens_per_device=4096, d_model=1024, d_ff=512, num_experts=64, top_k=4, ring_size=8,
                          expert_matrices=2)
  assert plan.expert_routing.forward_bytes_per_hop == 8 * 2 * 1024 * 512 * 2
  assert plan.expert_routing.backward_bytes_per_hop == 2 * 8 * 2 * 1024 * 512 * 2
  assert plan.mode == "ring_expert"  # 50.33 MB against 58.98 MB per hop


def test_bytes_match_hand_computation_f32_with_expert_tensor_parallelism():
  # T=1000, D=64, F=96, E=16, K=2, N=4, f32, ETP=2: L·W = 4·3·64·96·4/2 = 147 456; M = 2·(4+4) = 16.
  plan = rm.plan_dispatch(tokens_per_device=1000, d_model=64, d_ff=96, num_experts=16, top_k=2, ring_size=4,
                          dtype=jnp.float32, expert_tensor_parallel=2)
  assert plan.expert_routing.forward_bytes_per_hop == 147_456
  assert plan.expert_routing.backward_bytes_per_hop == 294_912
  assert plan.token_routing.forward_bytes_per_hop == 528_064
  assert plan.token_routing.backward_bytes_per_hop == 792_064
  assert plan.mode == "ring_expert"
  assert "ring_expert" in plan.reason and "ETP=2" in plan.reason


def test_mode_follows_tokens_against_expert_width():
  many_tokens_narrow = rm.plan_dispatch(tokens_per_device=65536, d_model=2048, d_ff=768, num_experts=128, top_k=8,
                                        ring_size=8)
  few_tokens_wide = rm.plan_dispatch(tokens_per_device=2048, d_model=2048, d_ff=2048, num_experts=384, top_k=8,
                                     ring_size=8)
  assert many_tokens_narrow.mode == "ring_expert" and few_tokens_wide.mode == "ring_token"
  # More expert tensor parallelism shrinks the weights that travel and can flip the choice back.
  shrunk = rm.plan_dispatch(tokens_per_device=16384, d_model=2048, d_ff=2048, num_experts=384, top_k=8,
                            ring_size=8, expert_tensor_parallel=8)
  unsplit = rm.plan_dispatch(tokens_per_device=16384, d_model=2048, d_ff=2048, num_experts=384, top_k=8,
                             ring_size=8)
  assert unsplit.mode == "ring_token" and shrunk.mode == "ring_expert"


@pytest.mark.parametrize("shape,names,e,d_ff,expected", [
    ((8,), E_ONLY, 8, 8, "ring_expert"),  # 8 tokens a device, narrow experts
    ((2, 4), DATA_EXPERT, 16, 64, "ring_token"),  # wide experts
])
def test_auto_runs_the_chosen_ring_and_matches_the_oracle(shape, names, e, d_ff, expected):
  tokens = 512 if expected == "ring_expert" else 64
  layer = random_layer(5, tokens, 16, d_ff, e, 2)
  mesh = mesh_of(shape, names)
  plan = rm.plan_dispatch(tokens_per_device=tokens // 8, d_model=16, d_ff=d_ff, num_experts=e, top_k=2,
                          ring_size=mesh.shape[rm.EXPERT], dtype=jnp.float32)
  assert plan.mode == expected
  assert_matches_oracle(layer, mesh, F32_RTOL, "auto")
