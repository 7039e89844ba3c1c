"""`relaymoe-train --profile START:COUNT`: steps START to START+COUNT-1 traced with `jax.profiler` into
OUT/profile/, then their device time by part of the model (`train.profile.step_parts`) printed and written to
OUT/profile/parts.json."""

import json
import pathlib
import time
from typing import NamedTuple

import jax

from relaymoe_jax.errors import UserError
from train.metrics import log_on_process_0
from train.profile.step_parts import module_name, render, step_parts
from train.profile.trace_events import find_trace, op_events


class Window(NamedTuple):
  start: int
  count: int


def parse_window(text):
  """Window of "START:COUNT" (START ≥ 0, COUNT ≥ 1); a ValueError naming `text` otherwise."""
  start, sep, count = text.partition(":")
  if not (sep and start.strip().isdigit() and count.strip().isdigit() and int(count) >= 1):
    raise UserError(f"--profile {text!r}: expected START:COUNT, the first step to profile and how many (integers, "
                    "COUNT at least 1), e.g. --profile 2:3")
  return Window(int(start), int(count))


def check_window(window, first_step, steps):
  """A ValueError unless the run's steps [first_step, steps) hold the window."""
  last = window.start + window.count - 1
  if window.start < first_step or last >= steps:
    raise UserError(f"--profile {window.start}:{window.count} profiles steps {window.start}-{last}, and this run "
                    f"trains steps {first_step}-{steps - 1}")


class StepProfiler:
  """Traces the window's steps of a loop that calls `before_step` and `after_step` around each step. Waits for the
  device at the window's ends only: the step time is the window's wall time (dispatch included) over its steps."""

  def __init__(self, window, trace_dir, compiled, tokens_per_step, flops_per_step, peak_tflops):
    self.window, self.compiled = window, compiled
    self.trace_dir = pathlib.Path(trace_dir)
    if jax.process_count() > 1:  # each host traces its own devices
      self.trace_dir = self.trace_dir / f"process_{jax.process_index()}"
    self.tokens_per_step, self.flops_per_step, self.peak_tflops = tokens_per_step, flops_per_step, peak_tflops
    self.started = None
    self.result = None

  def before_step(self, step, state):
    if step == self.window.start:
      jax.block_until_ready(state)
      jax.profiler.start_trace(str(self.trace_dir), create_perfetto_trace=True)
      self.started = time.perf_counter()

  def after_step(self, step, state):
    if step != self.window.start + self.window.count - 1:
      return
    jax.block_until_ready(state)
    wall_s = time.perf_counter() - self.started
    jax.profiler.stop_trace()
    self.result = self.summarize(wall_s)
    (self.trace_dir / "parts.json").write_text(json.dumps(self.result, indent=1))
    log_on_process_0(render(self.result, f"profile of steps {self.window.start}-{step} on the first device "
                                         f"(trace in {self.trace_dir}):"))

  def summarize(self, wall_s):
    """The part table of the window's trace, with tokens/s, TFLOP/s per device and MFU as the trainer computes
    them."""
    hlo_text = self.compiled.as_text()
    events = op_events(find_trace(str(self.trace_dir)), module_name(hlo_text))
    result = step_parts(events, hlo_text, self.window.count, wall_s)
    tflops = self.flops_per_step * self.window.count / wall_s / jax.device_count() / 1e12
    return dict(result, window=list(self.window), tokens_per_s=self.tokens_per_step * self.window.count / wall_s,
                tflops_per_device=tflops, mfu=tflops / self.peak_tflops if self.peak_tflops else None)
