"""What the benchmarks share: where results go, the machine a run ran on, writing results, merging several runs,
running pieces of a benchmark in child processes, and the registers and spills of compiled GPU kernels.

Imports no JAX: a benchmark's driver (argparse, child processes, merging, tables, plots) stays light, and whatever
needs JAX runs in a child or in a module that imports JAX at its top.
"""

import glob
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading

try:  # optional: without matplotlib a benchmark writes no plot (a Figure needs no pyplot and no backend)
  from matplotlib import ticker
  from matplotlib.figure import Figure
except ImportError:
  Figure = ticker = None

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "benchmarks", "results")
# Of each GPU's memory a benchmark process may allocate, unless XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise (JAX's
# default, 0.75, would put the out-of-memory points a quarter of the GPU early).
MEM_FRACTION = "0.95"


def machine(jax):
  """Python, JAX, XLA flags and the devices (with the NVIDIA driver when there is one) of this run, from the
  caller's `jax` module (this module imports none)."""
  devices = jax.devices()
  gpu = jax.default_backend() == "gpu"
  what = f"{len(devices)}x {devices[0].device_kind}" if gpu else f"{platform.machine()} CPU, emulated devices"
  try:
    driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                            capture_output=True, text=True, check=True).stdout.split()[0]
    what += f", driver {driver}"
  except (OSError, subprocess.CalledProcessError, IndexError):
    pass
  return dict(host=platform.node(), python=platform.python_version(), jax=jax.__version__,
              xla_flags=os.environ.get("XLA_FLAGS", ""), machine=what, backend=jax.default_backend(),
              device_kind=devices[0].device_kind, devices=len(devices),
              **({"mem_fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", MEM_FRACTION)} if gpu else {}))


def command_line(module, argv=None):
  """How this run was started, for its results' header."""
  return f"python -m benchmarks.{module} " + " ".join(sys.argv[1:] if argv is None else argv)


def sibling(path, ext):
  """`path` with its extension replaced: a results JSON's table (.txt) and plot (.png) lie beside it."""
  return os.path.splitext(path)[0] + ext


def load_json(path):
  with open(path) as fh:
    return json.load(fh)


def write_json(data, path):
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  with open(path, "w") as fh:
    json.dump(data, fh, indent=1)


def write_table(text, json_path):
  """The table of a results file, into the .txt beside it; returns the text."""
  with open(sibling(json_path, ".txt"), "w") as fh:
    fh.write(text + "\n")
  return text


def save_figure(fig, json_path):
  """The plot of a results file, into the .png beside it; returns its path."""
  path = sibling(json_path, ".png")
  fig.savefig(path, dpi=110)
  return path


def runs_of(meta):
  """The runs a results file holds: a merged file lists them (`runs`), a single run's meta is the one."""
  return meta.get("runs", [meta])


def merge_by_key(items, key, combine=None):
  """One item per key from the items of several runs, in first-seen order: a later item replaces (with
  `combine(earlier, later)`: is combined with) the earlier one of its key, in that one's place."""
  merged = {}
  for item in items:
    k = key(item)
    merged[k] = combine(merged[k], item) if combine and k in merged else item
  return list(merged.values())


def parse_options(options, flag="--xla-option"):
  """{KEY: VALUE} of `KEY=VALUE` strings (true/false and integers parsed); a string without `=` fails, naming it."""
  def parse(value):
    return {"true": True, "false": False}.get(value.lower(), int(value) if value.lstrip("-").isdigit() else value)

  parsed = {}
  for option in options:
    key, sep, value = option.partition("=")
    if not sep:
      raise ValueError(f"{flag} {option!r}: expected KEY=VALUE")
    parsed[key] = parse(value)
  return parsed


def child_env(**extra):
  """The environment of a benchmark's JAX child process. Without preallocation each process takes only what it
  uses, so processes waiting (or compiling) beside the one measuring leave the GPU to it (peak_bytes_in_use
  counts the allocator's use either way); that one may take MEM_FRACTION of the GPU."""
  return {"XLA_PYTHON_CLIENT_MEM_FRACTION": MEM_FRACTION, **os.environ, "PYTHONUNBUFFERED": "1",
          "XLA_PYTHON_CLIENT_PREALLOCATE": "false", **extra}


def json_child(cmd, env=None):
  """Runs `cmd` (from the repository root) and returns the JSON of its last line of output; a failure raises
  with the end of its error output."""
  proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
  if proc.returncode:
    raise RuntimeError(f"{' '.join(cmd[:4])} … exited {proc.returncode}: {proc.stderr[-1500:]}")
  return json.loads(proc.stdout.strip().splitlines()[-1])


class Child:
  """One job in its own process, which prints a JSON line when ready (`{"ready": true, …}`) or when it failed
  before that (`job` plus "error"), then reads a line from stdin and prints its result as JSON."""

  def __init__(self, job, cmd, env=None):
    self.job, self.result = job, None
    self.stderr = tempfile.TemporaryFile(mode="w+")
    self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True,
                                 cwd=REPO, env=env)

  def _message(self):
    for line in self.proc.stdout:
      if line.startswith("{"):
        return json.loads(line)
    self.proc.wait()
    self.stderr.seek(0)
    return dict(self.job, error=self.stderr.read()[-300:] or f"exit status {self.proc.returncode}")

  def wait_ready(self):
    message = self._message()
    if not message.get("ready"):  # failed before measuring
      self.result = message

  def measure(self, timeout_s):
    """The result; a process with no result after `timeout_s` is killed and its row says so, so one hung job
    does not cost the rest of a device call."""
    if self.result is None:
      self.proc.stdin.write("go\n")
      self.proc.stdin.flush()
      timed_out = threading.Event()

      def kill():
        timed_out.set()
        self.proc.kill()

      watchdog = threading.Timer(timeout_s, kill)
      watchdog.start()
      try:
        self.result = self._message()
      finally:
        watchdog.cancel()
      if timed_out.is_set():
        self.result = dict(self.job, error=f"no result within {timeout_s} s: killed")
    self.close()
    return self.result

  def close(self, wait_s=30):
    """Waits for the process to exit, killing it after `wait_s`: a step that ran out of memory on one GPU can leave
    the other GPU's send waiting forever, and then the process never exits (two stalled device calls did this)."""
    try:
      self.proc.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
      self.proc.kill()
      self.proc.wait()


def run_isolated(jobs, command, parallel=1, timeout_s=300, env=None):
  """Yields a result per job, each from its own process (`command(job)`): `parallel` processes get ready (compile)
  together, then measure one after another, so no measurement shares the device with another."""
  for start in range(0, len(jobs), parallel):
    batch = [Child(job, command(job), env) for job in jobs[start:start + parallel]]
    for child in batch:
      child.wait_ready()
    for child in batch:
      yield child.measure(timeout_s)


def wait_for_turn(ready):
  """The child's side of `Child`: says it is ready (with `ready`, a dict), then waits to be told to go."""
  print(json.dumps(dict(ready, ready=True)), flush=True)
  sys.stdin.readline()


# Registers and spills of a compiled GPU program's kernels, from a CPU host too: XLA dumps the program's PTX while
# compiling (deviceless compilation for a target GPU included), and `ptxas -v` reports each entry's registers per
# thread and the bytes it spills to local memory. A kernel that spills, or holds so many registers that few programs
# share an SM, is slow before any GPU runs it. ptxas is NVIDIA's: on PATH, or the `nvidia-cuda-nvcc-cu12` wheel that
# JAX's CUDA plugin brings.


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


def parse_ptxas(ptxas_output):
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
      report.update({name: v for name, v in parse_ptxas(run.stdout + run.stderr).items() if name.startswith(prefix)})
  return dict(sorted(report.items()))
