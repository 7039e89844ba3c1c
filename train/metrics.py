"""What a run reports: metrics.jsonl, TensorBoard and a progress bar (process 0), peak memory, and the devices'
peak FLOP/s for MFU. A metrics.jsonl that cannot be written stops the run (`LogWriteFailed`); TensorBoard that
cannot be written is turned off with a warning."""

import json
import pathlib
import sys
import time

import jax
import numpy as np
from tensorboardX.event_file_writer import EventsWriter
from tensorboardX.proto import event_pb2
from tensorboardX.summary import histogram, scalar
from tqdm import tqdm

import relaymoe_jax as rm
from train.rundir.directory import keep_metrics_before

# Dense bf16 peak per device, for MFU, by device kind.
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}


# Per MoE layer lists (`train.step.expert_load_metrics`) and the TensorBoard scalar of their worst layer.
WORST_LAYER = {"expert_load_max": max, "expert_load_min": min, "expert_load_cv": max, "dead_experts": max,
               "router_entropy": min, "dropped_pairs": max}
HISTOGRAM_ONLY = ("expert_tokens",)  # [Y, E]: TensorBoard histograms, one per layer; not in metrics.jsonl


class LogWriteFailed(OSError):
  """metrics.jsonl could not be written (a full disk, a vanished directory): the run stopped."""


class TensorBoard:
  """A TensorBoard event file written in the calling thread (tensorboardX's `EventsWriter`): the writer thread of
  tensorboardX's SummaryWriter, when a write fails, dies and leaves `add_scalar` and `close` blocked forever."""

  def __init__(self, directory, start_step):
    directory.mkdir(parents=True, exist_ok=True)
    self.events = EventsWriter(str(directory / "events"))
    if start_step:  # TensorBoard drops earlier files' events from this step on: a resumed run logs them again
      self.events.write_event(event_pb2.Event(step=start_step, wall_time=time.time(),
                                              session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START)))
    self.events.flush()

  def write(self, step, scalars, histograms=()):
    """`scalars` {tag: number}; `histograms` (tag, values) pairs."""
    now = time.time()
    summaries = [scalar(key, value) for key, value in scalars.items()]
    summaries += [histogram(key, np.asarray(values), bins="auto") for key, values in histograms]
    for summary in summaries:
      self.events.write_event(event_pb2.Event(wall_time=now, step=step, summary=summary))
    self.events.flush()

  def close(self):
    self.events.close()


class MetricsLog:
  """metrics.jsonl (every logged step), TensorBoard, and a progress bar; only process 0 writes."""

  def __init__(self, out_dir, total_steps, start_step, tensorboard, moe_layers=()):
    self.active = jax.process_index() == 0
    self.moe_layers = list(moe_layers)  # the model's layer of each entry of a per-layer list
    self.path = pathlib.Path(out_dir) / "metrics.jsonl"
    self.tensorboard = self.bar = None
    self.failure = None  # why metrics.jsonl does not write: the loop stops the run, saving a checkpoint
    if not self.active:
      return
    self.path.parent.mkdir(parents=True, exist_ok=True)
    keep_metrics_before(self.path, start_step)
    if tensorboard:
      try:
        self.tensorboard = TensorBoard(pathlib.Path(out_dir) / "tensorboard", start_step)
      except OSError as err:
        self._tensorboard_off(err)
    self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)

  def write(self, record):
    """Appends `record` to metrics.jsonl (where it cannot, sets `failure` and writes no more) and to TensorBoard
    (turned off, with a warning, where it cannot)."""
    if not self.active or self.failure:
      return
    try:
      with self.path.open("a") as fh:
        fh.write(json.dumps({k: v for k, v in record.items() if k not in HISTOGRAM_ONLY}) + "\n")
    except OSError as err:
      self.failure = f"cannot write {self.path} ({err.strerror or err})"
      return
    if self.tensorboard:
      try:
        self.tensorboard.write(record["step"], self._scalars(record), self._histograms(record))
      except OSError as err:
        self._tensorboard_off(err)
    if "eval_loss" in record:  # a held-out loss: a line of its own
      self.bar.write(f"after step {record['step'] + 1}: held-out loss {record['eval_loss']:.4f} (perplexity "
                     f"{record['eval_ppl']:.2f} over {record['eval_tokens']} tokens, {record['eval_s']:.1f} s)")
    if "loss" not in record:  # no step time
      return
    postfix = dict(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}",
                   tflops_dev=f"{record['tflops_per_device']:.3g}",
                   mem=size(record['peak_memory_bytes']))
    if record.get("mfu") is not None:
      postfix["mfu"] = f"{record['mfu']:.1%}"
    self.bar.set_postfix(postfix, refresh=False)

  def _scalars(self, record):
    scalars = {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
    return scalars | {f"moe/{k}_worst_layer": pick(record[k]) for k, pick in WORST_LAYER.items() if record.get(k)}

  def _histograms(self, record):
    """Per MoE layer: the tokens each expert got (`moe/tokens_per_expert/layer_N`, N the model's layer)."""
    return [(f"moe/tokens_per_expert/layer_{layer}", counts)
            for layer, counts in zip(self.moe_layers, record.get("expert_tokens", ()))]

  def advance(self):
    if self.bar:
      self.bar.update(1)

  def _tensorboard_off(self, err):
    board, self.tensorboard = self.tensorboard, None
    if board:
      try:
        board.close()
      except OSError:
        pass  # the write that failed said why
    print(f"relaymoe-train: warning: TensorBoard turned off, its files do not write ({err}); metrics.jsonl keeps "
          "every logged step", file=sys.stderr, flush=True)

  def close(self):
    if self.tensorboard:
      try:
        self.tensorboard.close()
      except OSError as err:
        self._tensorboard_off(err)
    if self.bar:
      self.bar.close()


def host_scalars(metrics):
  """Replicated metrics to Python: scalars to floats, per-layer arrays to lists (works when the array is not fully
  addressable, i.e. multi-process)."""

  def value(v):
    v = np.asarray(v.addressable_data(0))
    return float(v) if v.ndim == 0 else v.tolist()

  return {k: value(v) for k, v in metrics.items()}


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


def size(nbytes):
  """Bytes for a person: GiB, MiB or KiB, whichever reads as at least 1 (a small step read "0.00 GiB")."""
  if nbytes >= 2**30:
    return f"{nbytes / 2**30:.2f} GiB"
  return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f} KiB"


def log_on_process_0(message):
  if jax.process_index() == 0:
    print(message, flush=True)
