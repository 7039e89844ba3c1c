"""Stopping on SIGTERM or Ctrl-C without losing work: the signal only asks; the loop saves a checkpoint at the next
step boundary and raises `Stopped`. Before the first step, while the step is planned and compiled (`at_once`), there
is nothing to save: the run stops before its next compile (`check`). A second Ctrl-C ends the process at once,
without saving (exit status 130), even while the main thread is inside a compile.

No handler raises: an exception raised by a handler lands wherever the main thread is, and there it was lost (in a
gc callback of XLA's, "Exception ignored") or, raised inside jaxlib's compile (which runs Python's handlers while it
waits), left the compile running in C++ while Python shut down: a segmentation fault or `pure virtual method
called` (SIGABRT) a minute later."""

import contextlib
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
  """The run stopped on a signal after saving checkpoint `step` (None: before the first step, nothing to save);
  `exit_status` is the shell's 128 + signal number (143 for SIGTERM, 130 for SIGINT), so a wrapper script sees an
  unfinished run."""

  def __init__(self, signum, step=None, directory=None):
    self.signum, self.step = signum, step
    self.exit_status = 128 + signum
    super().__init__(f"stopped by {NAMES[signum]}: saved checkpoint step {step} in {directory}; continue with "
                     "--resume" if step is not None else
                     f"stopped by {NAMES[signum]} before the first step, while planning or compiling it: nothing "
                     "to save")


class StopRequest:
  """A context manager: inside it, SIGTERM and SIGINT set `signum` instead of killing the process.

  `requested()` is what the loop asks at each step boundary. With several processes they agree (a tiny
  all-gather each step), so all of them save the same step even if the signal reached only some. Inside `at_once()`
  a signal stops the run at the next `check` (before each compile) or at the end. A second Ctrl-C ends the process
  from a thread of its own (`_SecondCtrlC`). Outside the main thread (where Python cannot take signals) it installs
  nothing and never requests a stop.
  """

  def __init__(self):
    self.signum = None
    self.failed = False  # set by the loop: this process cannot go on (its metrics.jsonl does not write)
    self.previous = {}
    self.now = False  # inside `at_once`
    self.note = "saving a checkpoint after this step, then stopping"  # what the loop does on a signal now
    self.second_ctrl_c = None

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      self.previous = {s: signal.signal(s, self._handle) for s in NAMES}
      self.second_ctrl_c = _SecondCtrlC(self)
    return self

  def __exit__(self, *exc):
    for signum, handler in self.previous.items():
      signal.signal(signum, handler)
    self.previous = {}
    if self.second_ctrl_c:
      self.second_ctrl_c.close()
      self.second_ctrl_c = None

  @contextlib.contextmanager
  def at_once(self):
    """Inside: a signal stops the run before the next compile (`check`) or at the end, raising `Stopped` with
    nothing saved (no step has run)."""
    global _AT_ONCE
    self.now, _AT_ONCE = True, self
    try:
      check()
      yield
    finally:
      self.now, _AT_ONCE = False, None
    if self.signum:
      raise Stopped(self.signum)

  def _handle(self, signum, frame):
    if self.signum is None:  # a repeated signal: already stopping (a second Ctrl-C is `_SecondCtrlC`'s)
      self.signum = signum

  def announcement(self, signum):
    """The line said when a first signal arrives."""
    doing = "stopping after the compile in flight (no step has run: nothing to save)" if self.now else self.note
    return f"\nrelaymoe-train: got {NAMES[signum]}; {doing} (Ctrl-C again to abort without saving)\n"

  def requested(self):
    """The signal number every process should stop for now, FAILED where a process `failed`, or None."""
    own = FAILED if self.failed else self.signum or 0
    if jax.process_count() == 1:
      return own or None
    signums = multihost_utils.process_allgather(np.int32(own))
    return int(np.max(signums)) or None


_AT_ONCE = None  # the StopRequest inside `at_once`, if any


def check():
  """Raises `Stopped` where a signal arrived inside a StopRequest's `at_once` (the trainer's compiles call it
  before they start, in any thread)."""
  stop = _AT_ONCE
  if stop is not None and stop.signum:
    raise Stopped(stop.signum)


ABORTED = "relaymoe-train: interrupted again: aborted without saving\n"


class _SecondCtrlC:
  """A thread that sees each signal as it arrives (Python's signal wakeup fd), says the first, and ends the process
  on a Ctrl-C after it: os._exit(130), so no exception lands in the main thread's C++ (an XLA compile) or callbacks,
  and no destructor runs under a compile still in flight."""

  def __init__(self, stop):
    self.stop = stop
    self.read_fd, self.write_fd = os.pipe()
    os.set_blocking(self.write_fd, False)
    self.previous_fd = signal.set_wakeup_fd(self.write_fd, warn_on_full_buffer=False)
    self.thread = threading.Thread(target=self._watch, name="relaymoe-second-ctrl-c", daemon=True)
    self.thread.start()

  def _watch(self):
    seen = 0
    while data := os.read(self.read_fd, 64):
      for signum in data:
        if signum not in NAMES:
          continue
        if seen and signum == signal.SIGINT:
          os.write(2, ABORTED.encode())
          os._exit(128 + signal.SIGINT)
        if not seen:
          os.write(2, self.stop.announcement(signum).encode())  # os.write: a print may be under way
        seen += 1
    os.close(self.read_fd)

  def close(self):
    signal.set_wakeup_fd(self.previous_fd)
    os.close(self.write_fd)  # the thread reads the end of the pipe and ends
    self.thread.join()
