"""Grouped matmuls: the interface every dispatcher calls (`interface`), the backends by name (`grouped_matmul`:
`lax.ragged_dot` everywhere, the Hopper kernels on H100/H200) and the Pallas Mosaic GPU kernels themselves."""
