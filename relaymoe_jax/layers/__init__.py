"""The MoE block as Flax layers: what both share (`block`: parameters, routing, the shared expert), Linen
(`linen`) and NNX (`nnx`). Only these modules import Flax; `relaymoe_jax.linen` / `.nnx` load them on first use."""
