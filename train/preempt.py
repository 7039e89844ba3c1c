"""Stopping on SIGTERM or Ctrl-C without losing work: the signal only asks; the loop saves a checkpoint at the next
step boundary and raises `Stopped`. A second Ctrl-C aborts at once (KeyboardInterrupt), without saving."""

import os
import signal
import threading

import jax
import numpy as np
from jax.experimental import multihost_utils

NAMES = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "SIGINT"}
# What `requested()` returns when a process failed to write its logs: above any signal number, so it prevails.
FAILED = 1 << 10


class Stopped(Exception):  # noqa: N818  (not an error: the run stopped as asked)
  """The run stopped on a signal after saving checkpoint `step`; `exit_status` is the shell's 128 + signal number
  (143 for SIGTERM, 130 for SIGINT), so a wrapper script sees an unfinished run."""

  def __init__(self, signum, step, directory):
    self.signum, self.step = signum, step
    self.exit_status = 128 + signum
    super().__init__(f"stopped by {NAMES[signum]}: saved checkpoint step {step} in {directory}; continue with "
                     "--resume")


class StopRequest:
  """A context manager: inside it, SIGTERM and SIGINT set `signum` instead of killing the process.

  `requested()` is what the loop asks at each step boundary. With several processes they agree (a tiny
  all-gather each step), so all of them save the same step even if the signal reached only some. Outside the main
  thread (where Python cannot take signals) it installs nothing and never requests a stop.
  """

  def __init__(self):
    self.signum = None
    self.failed = False  # set by the loop: this process cannot go on (its metrics.jsonl does not write)
    self.previous = {}
    self.note = "saving a checkpoint after this step, then stopping"  # what the loop does on a signal now

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      self.previous = {s: signal.signal(s, self._handle) for s in NAMES}
    return self

  def __exit__(self, *exc):
    for signum, handler in self.previous.items():
      signal.signal(signum, handler)
    self.previous = {}

  def _handle(self, signum, frame):
    if self.signum is not None:
      if signum == signal.SIGINT:
        raise KeyboardInterrupt
      return  # a repeated SIGTERM (some launchers send one per process group member): already stopping
    self.signum = signum
    # os.write, not print: a handler may run in the middle of another print to the same stream.
    os.write(2, f"\nrelaymoe-train: got {NAMES[signum]}; {self.note} (Ctrl-C again to abort without saving)\n"
             .encode())

  def requested(self):
    """The signal number every process should stop for now, FAILED where a process `failed`, or None."""
    own = FAILED if self.failed else self.signum or 0
    if jax.process_count() == 1:
      return own or None
    signums = multihost_utils.process_allgather(np.int32(own))
    return int(np.max(signums)) or None
