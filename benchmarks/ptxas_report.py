"""Registers and spills of a compiled GPU program's kernels, from a CPU host: XLA dumps the program's PTX while
compiling (deviceless compilation for a target GPU included, `--compile-only`), and `ptxas -v` reports each entry's
registers per thread and the bytes it spills to local memory. A kernel that spills, or holds so many registers that
few programs share an SM, is slow before any GPU runs it.

ptxas is NVIDIA's (on PATH, or the `nvidia-cuda-nvcc-cu12` wheel that JAX's CUDA plugin brings); without it the
report is None.
"""

import glob
import importlib.util
import os
import re
import shutil
import subprocess
import tempfile


def find_ptxas():
  """ptxas on PATH, else the one in the nvidia-cuda-nvcc wheel, else None."""
  found = shutil.which("ptxas")
  if found:
    return found
  try:
    wheel = importlib.util.find_spec("nvidia.cuda_nvcc")
  except ModuleNotFoundError:  # no `nvidia` namespace at all
    return None
  candidates = [os.path.join(path, "bin", "ptxas") for path in (wheel.submodule_search_locations if wheel else [])]
  return next((c for c in candidates if os.path.exists(c)), None)


def parse(ptxas_output):
  """{entry: (registers, spill store bytes)} from `ptxas -v`'s report."""
  report, entry = {}, None
  for line in ptxas_output.splitlines():
    match = re.search(r"entry function '(\w+)'", line)
    if match:
      entry = match.group(1)
      report[entry] = [None, None]
      continue
    spills = re.search(r"(\d+) bytes spill stores", line)
    if entry and spills:
      report[entry][1] = int(spills.group(1))
    registers = re.search(r"Used (\d+) registers", line)
    if entry and registers:
      report[entry][0] = int(registers.group(1))
  return {name: tuple(values) for name, values in report.items()}


def kernel_registers(lowered, prefix):
  """{kernel: (registers, spill store bytes)} of `lowered`'s kernels whose names start with `prefix`, compiled with
  XLA dumping its PTX; None without ptxas."""
  ptxas = find_ptxas()
  if ptxas is None:
    return None
  with tempfile.TemporaryDirectory() as dump:
    lowered.compile({"xla_dump_to": dump})
    report = {}
    for ptx in glob.glob(os.path.join(dump, "*.ptx")):
      text = open(ptx, encoding="utf-8").read()
      if f".entry {prefix}" not in text:
        continue
      target = re.search(r"^\.target (\w+)", text, re.MULTILINE).group(1)
      run = subprocess.run([ptxas, "-v", f"-arch={target}", ptx, "-o", os.devnull], capture_output=True, text=True,
                           check=True)
      report.update({name: v for name, v in parse(run.stdout + run.stderr).items() if name.startswith(prefix)})
  return dict(sorted(report.items()))
