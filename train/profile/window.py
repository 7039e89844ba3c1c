"""`relaymoe-train --profile START:COUNT`: steps START to START+COUNT-1 traced with `jax.profiler` into
OUT/profile/, then their device time by part of the model (`train.profile.step_parts`) printed and written to
OUT/profile/parts.json."""

import json
import os
import pathlib
import sys
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


def check_window(window, first_step, steps, trace_dir=None):
  """A ValueError unless the run's steps [first_step, steps) hold the window and `trace_dir` can be made and
  written (JAX's trace failed at the window's end, and the run with it)."""
  last = window.start + window.count - 1
  if window.start < first_step or last >= steps:
    raise UserError(f"--profile {window.start}:{window.count} profiles steps {window.start}-{last}, and this run "
                    f"trains steps {first_step}-{steps - 1}")
  if trace_dir is None:
    return
  existing = next(p for p in (pathlib.Path(trace_dir), *pathlib.Path(trace_dir).parents) if p.exists())
  if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
    what = "is not a directory" if not existing.is_dir() else "cannot be written"
    raise UserError(f"--profile writes its trace to {trace_dir}, and {existing} {what}")


class StepProfiler:
  """Traces the window's steps of a loop that calls `before_step` and `after_step` around each step. Waits for the
  device at the window's ends only: the step time is the window's wall time (dispatch included) over its steps."""

  def __init__(self, window, trace_dir, compiled, tokens_per_step, flops_per_step, peak_tflops):
    self.window, self.compiled = window, compiled
    self.trace_dir = pathlib.Path(trace_dir)
    if jax.process_count() > 1:  # each host traces its own devices
      self.trace_dir = self.trace_dir / f"process_{jax.process_index()}"
    self.tokens_per_step, self.flops_per_step, self.peak_tflops = tokens_per_step, flops_per_step, peak_tflops
    self.started = None  # while the window is open
    self.tracing, self.excluded, self.result = False, 0.0, None

  def before_step(self, step, state):
    """Starts the trace at the window's first step; returns the seconds that took (not a step's)."""
    if step != self.window.start:
      return 0.0
    jax.block_until_ready(state)
    begun = time.perf_counter()
    self.tracing = self._traced(jax.profiler.start_trace, str(self.trace_dir), create_perfetto_trace=True)
    self.started = time.perf_counter()
    return self.started - begun

  def after_step(self, step, state):
    """Ends the trace at the window's last step and prints its table; returns the seconds that took (not a
    step's). A trace that does not write is a warning: the run goes on."""
    if step != self.window.start + self.window.count - 1:
      return 0.0
    jax.block_until_ready(state)
    ended = time.perf_counter()
    wall_s, self.started = ended - self.started - self.excluded, None
    if self.tracing and self._traced(jax.profiler.stop_trace):
      self.result = self.summarize(wall_s)
      if self._traced((self.trace_dir / "parts.json").write_text, json.dumps(self.result, indent=1)):
        log_on_process_0(render(self.result, f"profile of steps {self.window.start}-{step} on the first device "
                                             f"(trace in {self.trace_dir}):"))
    return time.perf_counter() - ended

  def exclude(self, seconds):
    """`seconds` inside the window that are not its steps' (an evaluation)."""
    if self.started is not None:
      self.excluded += seconds

  def _traced(self, write, *args, **kwargs):
    """Whether `write` of the trace worked; where not, a warning (the steps go on untraced)."""
    try:
      write(*args, **kwargs)
      return True
    except (OSError, jax.errors.JaxRuntimeError) as err:
      print(f"relaymoe-train: warning: the profile of steps {self.window.start}-{sum(self.window) - 1} is not "
            f"written to {self.trace_dir} ({str(err).splitlines()[0]}); training goes on", file=sys.stderr,
            flush=True)
      return False

  def summarize(self, wall_s):
    """The part table of the window's trace, with tokens/s, TFLOP/s per device and MFU as the trainer computes
    them."""
    hlo_text = self.compiled.as_text()
    events = op_events(find_trace(str(self.trace_dir)), module_name(hlo_text))
    result = step_parts(events, hlo_text, self.window.count, wall_s)
    tflops = self.flops_per_step * self.window.count / wall_s / jax.device_count() / 1e12
    return dict(result, window=list(self.window), tokens_per_s=self.tokens_per_step * self.window.count / wall_s,
                tflops_per_device=tflops, mfu=tflops / self.peak_tflops if self.peak_tflops else None)
