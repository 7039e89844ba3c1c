"""What a run reports: metrics.jsonl, TensorBoard and a progress bar (process 0), peak memory, and the devices'
peak FLOP/s for MFU."""

import json
import pathlib

import jax
import numpy as np
from tensorboardX import SummaryWriter
from tqdm import tqdm

import relaymoe_jax as rm
from train.rundir import keep_metrics_before

# Dense bf16 peak per device, for MFU, by device kind.
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}


class MetricsLog:
  """metrics.jsonl (every logged step), TensorBoard, and a progress bar; only process 0 writes."""

  def __init__(self, out_dir, total_steps, start_step, tensorboard):
    self.active = jax.process_index() == 0
    self.path = pathlib.Path(out_dir) / "metrics.jsonl"
    self.writer = self.bar = None
    if not self.active:
      return
    self.path.parent.mkdir(parents=True, exist_ok=True)
    keep_metrics_before(self.path, start_step)
    if tensorboard:
      self.writer = SummaryWriter(str(pathlib.Path(out_dir) / "tensorboard"))
    self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)

  def write(self, record):
    if not self.active:
      return
    with self.path.open("a") as fh:
      fh.write(json.dumps(record) + "\n")
    if self.writer:
      for key, value in record.items():
        if key != "step" and isinstance(value, (int, float)):
          self.writer.add_scalar(key, value, record["step"])
    postfix = dict(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}",
                   tflops_dev=f"{record['tflops_per_device']:.3g}",
                   mem_gib=f"{record['peak_memory_bytes'] / 2**30:.2f}")
    if record.get("mfu") is not None:
      postfix["mfu"] = f"{record['mfu']:.1%}"
    self.bar.set_postfix(postfix, refresh=False)

  def advance(self):
    if self.bar:
      self.bar.update(1)

  def close(self):
    if self.writer:
      self.writer.close()
    if self.bar:
      self.bar.close()


def host_scalars(metrics):
  """Replicated scalars to Python floats (works when the array is not fully addressable, i.e. multi-process)."""
  return {k: float(np.asarray(v.addressable_data(0))) for k, v in metrics.items()}


def peak_memory_bytes(compiled):
  """Peak device memory so far from the allocator where it reports one (GPU); else XLA's compiled estimate of the
  train step (`rm.compiled_bytes`)."""
  stats = [d.memory_stats() or {} for d in jax.local_devices()]
  peaks = [s["peak_bytes_in_use"] for s in stats if "peak_bytes_in_use" in s]
  return max(peaks) if peaks else rm.compiled_bytes(compiled)


def peak_tflops(run, devices=None):
  """Dense bf16 peak TFLOP/s of one device: the run's `peak_tflops_per_device`, else by device kind (None where
  unknown). `devices`: those the run is for (default this process's)."""
  if run.peak_tflops_per_device:
    return run.peak_tflops_per_device
  kind = (devices or jax.devices())[0].device_kind
  return next((v for k, v in PEAK_TFLOPS.items() if k in kind), None)


def log_on_process_0(message):
  if jax.process_index() == 0:
    print(message, flush=True)
