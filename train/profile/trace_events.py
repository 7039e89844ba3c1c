"""The device's events in a `jax.profiler` trace: the Perfetto JSON that `jax.profiler.trace(dir,
create_perfetto_trace=True)` (or `start_trace`) writes, read per device.

On GPUs each device is a process (`/device:GPU:N`) whose stream threads hold the kernels and memcpys; XLA names
each kernel's HLO instruction and module in its args (`hlo_op`, `hlo_module`). On XLA:CPU the ops run on host
threads, each event with the same args and the device's `device_ordinal`; control flow (a while loop) is an event
holding its body's events.
"""

import glob
import gzip
import json
import os
from typing import NamedTuple


class OpEvent(NamedTuple):
  name: str  # the kernel's (GPU) or the op's (CPU) name
  hlo_op: str | None  # the HLO instruction it ran, where the trace says
  start_us: float
  dur_us: float


def find_trace(trace_dir):
  paths = sorted(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True))
  if not paths:
    raise FileNotFoundError(f"no perfetto_trace.json.gz under {trace_dir}")
  return paths[-1]


def load_events(path):
  with gzip.open(path) as fh:
    events = json.load(fh)
  return events["traceEvents"] if isinstance(events, dict) else events


def _metadata(events, kind):
  return {(e["pid"], e.get("tid")) if kind == "thread_name" else e["pid"]: e["args"].get("name", "")
          for e in events if e.get("ph") == "M" and e.get("name") == kind}


def device_kernels(path, device="GPU:0"):
  """The kernel events (complete events, "X") of `device`'s process in the trace, by start time."""
  events = load_events(path)
  pids = {pid for pid, name in _metadata(events, "process_name").items() if device in name}
  return sorted((e for e in events if e.get("ph") == "X" and e.get("pid") in pids), key=lambda e: e["ts"])


def _gpu_events(events):
  """The first GPU's stream events (all its threads where none is named as a stream)."""
  gpus = sorted((name, pid) for pid, name in _metadata(events, "process_name").items() if "/device:GPU:" in name)
  if not gpus:
    return None
  pid = gpus[0][1]
  streams = {tid for (p, tid), name in _metadata(events, "thread_name").items()
             if p == pid and "stream" in name.lower()}
  return [e for e in events if e.get("ph") == "X" and e["pid"] == pid and (not streams or e.get("tid") in streams)]


def _of_module(event, module):
  name = event.get("args", {}).get("hlo_module")
  return name is not None and (module is None or name.split("(")[0].strip() == module)


def op_events(path, module=None):
  """[OpEvent] of the first device, by start time: on GPUs its stream events (the kernels of `module`, the HLO
  module's name, and those of no module: memcpys), on CPU the events of `module` on the first device ordinal."""
  events = load_events(path)
  gpu = _gpu_events(events)
  if gpu is None:
    ops = [e for e in events if e.get("ph") == "X" and _of_module(e, module)]
    first = min((e["args"].get("device_ordinal", "0") for e in ops), key=int, default="0")
    ops = [e for e in ops if e["args"].get("device_ordinal", "0") == first]
  else:
    ops = [e for e in gpu if _of_module(e, module) or "hlo_module" not in e.get("args", {})]
  return sorted((OpEvent(e["name"], e.get("args", {}).get("hlo_op"), e["ts"], e["dur"]) for e in ops),
                key=lambda e: e.start_us)


def union_us(intervals):
  """The time covered by [(start, stop)] intervals that may overlap."""
  total, end = 0.0, float("-inf")
  for start, stop in sorted(intervals):
    if stop > end:
      total += stop - max(start, end)
      end = stop
  return total
