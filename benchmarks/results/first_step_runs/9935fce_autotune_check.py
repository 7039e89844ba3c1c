"""The 4-layer step's compile with and without XLA's GPU autotuner: time and bytes."""
import sys, time
from train.config import load_run_config
from train.compile import compile_step, memory_plan
from train.plan import with_remat
for name, overrides in (("a2a_16x4096", ["runtime.dispatcher=all_to_all"]), ("ring_65536", ["batch_size=1", "seq_len=65536"])):
  config = with_remat(load_run_config("ep8", overrides + ["compilation_cache_dir=''"]), "layer")
  for memory_only in (True, False):
    step = compile_step(config, memory_only=memory_only)
    plan = memory_plan(config, step)
    print(f"{name} memory_only={memory_only} compile_s={step.compile_s:.1f} total_bytes={plan['total_bytes']} "
          f"temp_bytes={plan['temp_bytes']}", flush=True)
