"""XLA options under which the rings overlap their sends with compute on GPUs: pass them to the `jax.jit` that
contains the MoE layer, `jax.jit(step, compiler_options=rm.COMPILER_OPTIONS)` (the trainer and the benchmarks do).
Other backends ignore them. Measurements: docs/overlap.md.
"""

COMPILER_OPTIONS = {
    # A ring send is a pair of arrays (gate+up, down), compiled as one collective-permute each. XLA's default of one
    # collective in flight made the compute of the next hop wait for the first of the pair (2×H200 trace: 1.9 ms
    # exposed per gradient send at 16384 tokens per GPU); with two in flight both overlap the hop.
    "xla_gpu_experimental_parallel_collective_overlap_limit": 2,
}


def compiled_bytes(compiled):
  """Device memory a compiled program needs per device, by XLA's buffer assignment: arguments + outputs +
  temporaries, donated arguments counted once."""
  m = compiled.memory_analysis()
  return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)
