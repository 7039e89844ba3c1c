"""Flax (NNX) models that call the relaymoe_jax MoE block."""
