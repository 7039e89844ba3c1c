"""Host memory of importing a multi-file Hugging Face checkpoint (`models.hf.transfer.from_hf`) on 8 emulated CPU devices.

    python -m benchmarks.hf_load_memory [--dir /tmp/hf_load_memory] [--keep]

Writes a random ~2.5 GB float32 qwen3_moe checkpoint with `to_hf` (512 MiB files + index), then loads it in fresh
processes and reports peak RSS (`resource.getrusage`): after imports and JAX start (baseline), and after loading,
(a) with `from_hf` (each device's slice read, then placed on its device before the next is read), (b) with the same
reads through `jax.make_array_from_callback` (which holds every local device's slice before placing any), and (c)
with every tensor first read whole into host memory (`safetensors.numpy.load_file`, held while loading), what a
whole-checkpoint loader costs. On CPU
devices the parameters themselves live in host memory, so the loaded model's own bytes (every device's shards;
replicated parameters once per device) are reported and subtracted: what is left is the loader's overhead.
Writes benchmarks/results/hf_load_memory.txt.
"""

import argparse
import json
import os
import pathlib
import platform
import resource
import shutil
import subprocess
import sys
import time

if __name__ == "__main__" and "jax" not in sys.modules:
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from benchmarks.harness import REPO, RESULTS

MIB = 2 ** 20
# Experts dominate, as in real MoE checkpoints: 6 MoE layers of 64 experts, D 1024, F 512 (2.4 GB of 2.5 GB).
CONFIG = dict(vocab_size=8192, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512,
              num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4, head_dim=64, num_experts=64,
              num_experts_per_tok=4, param_dtype="float32")
RUNTIME = dict(dtype="float32")  # `RuntimeConfig` fields: float32 compute
MESH = dict(data=1, expert=8, tensor=1)  # experts split 8 ways, the rest replicated on every device
MAX_SHARD_BYTES = 512 * MIB
MODES = {"sliced": "from_hf (each device's slice read and placed in turn)",
         "callback": "the same reads through jax.make_array_from_callback (every local slice held, then placed)",
         "whole": "from_hf with the whole checkpoint read into host memory first"}


def _peak_rss_bytes():
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


# JAX and the models are imported inside the functions, in a child process: XLA_FLAGS must be set first.
def _mesh():
  from train.config import MeshConfig
  from train.mesh import build_mesh
  return build_mesh(MeshConfig(**MESH))


def make(out_dir):
  from models.hf import transfer as hf
  from models.qwen3 import model as qwen3
  from models.qwen3.config import Qwen3MoEConfig
  from models.runtime import RuntimeConfig
  model = qwen3.create_sharded(Qwen3MoEConfig(**CONFIG), _mesh(), seed=0, runtime=RuntimeConfig(**RUNTIME))
  files = hf.to_hf(model, out_dir, max_shard_bytes=MAX_SHARD_BYTES)
  print(json.dumps({"files": files}))


def measure(hf_dir, mode):
  import jax
  from flax import nnx
  from safetensors.numpy import load_file

  from models.hf import transfer as hf
  from models.runtime import RuntimeConfig
  mesh = _mesh()
  jax.block_until_ready(jax.device_put(0.0))
  baseline = _peak_rss_bytes()
  start = time.perf_counter()
  held = [load_file(f) for f in sorted(pathlib.Path(hf_dir).glob("*.safetensors"))] if mode == "whole" else []
  config = hf.config_from_hf(hf_dir, param_dtype=CONFIG["param_dtype"])
  model = nnx.merge(*hf.load_params(config, mesh, hf_dir, device_by_device=mode != "callback",
                                    runtime=RuntimeConfig(**RUNTIME)))
  params = jax.tree.leaves(nnx.state(model, nnx.Param))
  jax.block_until_ready(params)
  seconds = time.perf_counter() - start
  slices = [s.data.nbytes for p in params for s in p.addressable_shards]
  del held
  print(json.dumps(dict(mode=mode, baseline=baseline, peak=_peak_rss_bytes(), resident=sum(slices),
                        seconds=seconds, largest_slice=max(slices))))


def _child(*args):
  out = subprocess.run([sys.executable, "-m", "benchmarks.hf_load_memory", *args], check=True, capture_output=True,
                       text=True, cwd=REPO)
  return json.loads(out.stdout.strip().splitlines()[-1])


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--dir", default="/tmp/hf_load_memory")
  parser.add_argument("--keep", action="store_true", help="keep (and reuse) the checkpoint")
  parser.add_argument("--child", nargs=2, metavar=("WHAT", "DIR"), help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    what, hf_dir = args.child
    make(hf_dir) if what == "make" else measure(hf_dir, what)
    return
  hf_dir = pathlib.Path(args.dir)
  if not (hf_dir / "config.json").exists():
    _child("--child", "make", str(hf_dir))
  files = sorted(hf_dir.glob("*.safetensors"))
  checkpoint = sum(f.stat().st_size for f in files)
  runs = [_child("--child", mode, str(hf_dir)) for mode in MODES]
  import jax
  lines = [f"# hf_load_memory: peak RSS importing a {len(files)}-file float32 qwen3_moe checkpoint on 8 emulated CPU "
           f"devices (cpu, jax {jax.__version__}, python {platform.python_version()})",
           f"# command: python -m benchmarks.hf_load_memory   (model {CONFIG}, runtime {RUNTIME}, mesh {MESH}, "
           f"files of {MAX_SHARD_BYTES // MIB} MiB)",
           f"checkpoint on disk: {checkpoint / MIB:.0f} MiB in {len(files)} files",
           "| loader | baseline MiB | peak MiB | loaded model's bytes on the 8 devices MiB | overhead = peak − "
           "baseline − model MiB | overhead / checkpoint | seconds |", "|---|---|---|---|---|---|---|"]
  for run in runs:
    overhead = run["peak"] - run["baseline"] - run["resident"]
    name = MODES[run["mode"]]
    lines.append(f"| {name} | {run['baseline'] / MIB:.0f} | {run['peak'] / MIB:.0f} | {run['resident'] / MIB:.0f} | "
                 f"{overhead / MIB:.0f} | {overhead / checkpoint:.2f} | {run['seconds']:.1f} |")
  lines.append(f"largest slice one device holds (one stacked expert weight, 6 layers x 8 experts): "
               f"{runs[0]['largest_slice'] / MIB:.0f} MiB")
  text = "\n".join(lines) + "\n"
  print(text)
  pathlib.Path(RESULTS, "hf_load_memory.txt").write_text(text)
  if not args.keep:
    shutil.rmtree(hf_dir)


if __name__ == "__main__":
  main()
