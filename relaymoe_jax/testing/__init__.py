"""Checks for your own tests: random MoE inputs, and a MoE block under a dispatcher against the dense oracle.

No communication of its own: the checks call `moe_ffn` on your mesh, once with your dispatcher and once with
"dense" on float32 copies of the same inputs. Not imported by `import relaymoe_jax` (it needs chex, not pytest):

    import relaymoe_jax.testing as rmt

    inputs = rmt.random_moe_inputs(0, tokens=64, d_model=16, d_ff=24, num_experts=16, top_k=4)
    rmt.assert_matches_dense_oracle(mesh=mesh, dispatcher="ring_expert", rtol=1e-5, **inputs)
    rmt.assert_block_matches_dense_oracle(my_block, x_BSD, rtol=1e-5)   # a whole block: router and all

Closeness is the max-norm relative error max|a − b| / max|b| of each array, not an elementwise tolerance: a
gradient's small entries carry the absolute rounding of its large ones. Shape letters: see relaymoe_jax.
"""

from relaymoe_jax.testing.blocks import (assert_block_matches_dense_oracle, assert_layer_matches_dense_oracle,
                                         block_values_and_grads, layer_values_and_grads)
from relaymoe_jax.testing.closeness import (assert_trees_close, cotangent, named_leaves, relative_error,
                                            where_they_differ)
from relaymoe_jax.testing.functional import (DIFF_ARGS, MOE_ARGS, assert_matches_dense_oracle, dense_oracle,
                                             random_moe_inputs, values_and_grads)

__all__ = [
    "DIFF_ARGS", "MOE_ARGS", "assert_block_matches_dense_oracle", "assert_layer_matches_dense_oracle",
    "assert_matches_dense_oracle", "assert_trees_close", "block_values_and_grads", "cotangent", "dense_oracle",
    "layer_values_and_grads", "named_leaves", "random_moe_inputs", "relative_error", "values_and_grads",
    "where_they_differ",
]
