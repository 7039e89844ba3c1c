"""The run directory (`--out`): one run at a time, no fresh run on top of an earlier one unless asked, and a resumed
run's metrics.jsonl cut back to where it resumes.

Process 0 decides (it alone writes metrics and logs; all processes share the directory) and tells the others.
"""

import fcntl
import json
import os
import pathlib
import shutil
import socket

import jax
import numpy as np
from jax.experimental import multihost_utils

from relaymoe_jax.errors import UserError

LOCK = ".lock"
# What a run writes; --overwrite removes these and nothing else in the directory.
RUN_OUTPUTS = ("checkpoints", "metrics.jsonl", "tensorboard", "run_config.json")
UNFINISHED_SAVE = ".orbax-checkpoint-tmp"  # in the name of a checkpoint orbax is still writing


class RunDirectoryError(RuntimeError):
  """The run directory cannot be used as asked: another run holds it, or it holds an earlier run."""


def checkpoint_steps(directory):
  """The finished checkpoint steps under `directory`, ascending (orbax names a save in progress with a suffix)."""
  path = pathlib.Path(directory)
  return sorted(int(p.name) for p in path.iterdir() if p.name.isdigit()) if path.is_dir() else []


class RunDirectory:
  """Claims `out_dir` for one run, as a context manager.

  Process 0 takes an exclusive `flock` on OUT/.lock, which the OS drops when the process ends however it ends (a
  killed run leaves no stale lock); the lock file names the holder. A fresh run (not `resume`) into a directory
  holding an earlier run's checkpoint or metrics is refused unless `overwrite`, which removes `RUN_OUTPUTS`.
  """

  def __init__(self, out_dir, *, resume=False, overwrite=False):
    if resume and overwrite:
      raise UserError("--resume continues the run in the directory and --overwrite deletes it: pass one")
    self.out = pathlib.Path(out_dir)
    self.resume, self.overwrite = resume, overwrite
    self.handle = None
    self.created = False

  def __enter__(self):
    error = None
    if jax.process_index() == 0:
      try:
        self._lock()
        self._check_fresh()
        self._remove_unfinished_saves()
      except Exception as err:  # noqa: BLE001  (re-raised below, after the other processes heard of it)
        error = err
    if jax.process_count() > 1:
      failed = bool(multihost_utils.broadcast_one_to_all(np.int32(error is not None)))
      if failed and error is None:
        error = RunDirectoryError(f"process 0 could not claim the run directory {self.out}; its error says why")
    if error is not None:
      self._unlock()
      raise error
    return self

  def __exit__(self, exc_type, *exc):
    if exc_type is not None and self.handle:
      self._remove_if_unused()
    self._unlock()

  def _remove_if_unused(self):
    """A run that failed before it wrote anything (a config error found after the lock) leaves nothing behind:
    not its empty checkpoints/, its lock file, nor the directory it made."""
    if any((self.out / name).exists() for name in RUN_OUTPUTS if name != "checkpoints"):
      return
    try:
      (self.out / "checkpoints").rmdir()
    except FileNotFoundError:
      pass
    except OSError:
      return  # not empty: a run's files
    (self.out / LOCK).unlink(missing_ok=True)  # still held: a run that opened it meanwhile sees it gone
    if self.created:
      try:
        self.out.rmdir()
      except OSError:
        pass  # someone put something there

  def _lock(self):
    if self.out.exists() and not self.out.is_dir():
      raise RunDirectoryError(f"--out {self.out} is a file, not a directory")
    try:
      self.created = not self.out.exists()
      self.out.mkdir(parents=True, exist_ok=True)
      while True:
        handle = (self.out / LOCK).open("a+")
        try:
          fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
          handle.seek(0)
          holder = handle.read().split() or ["unknown", "?"]
          handle.close()
          raise RunDirectoryError(f"{self.out} is in use by another run (pid {holder[0]} on {holder[-1]}); wait "
                                  "for it to end or pick another --out") from None
        if _same_file(handle, self.out / LOCK):
          break
        handle.close()  # locked a lock file that a failed run removed meanwhile: lock the one there now
    except OSError as err:
      raise RunDirectoryError(f"--out {self.out}: cannot use it as the run directory ({_reason(err)})") from None
    handle.truncate(0)
    handle.write(f"{os.getpid()} {socket.gethostname()}\n")
    handle.flush()
    self.handle = handle

  def _unlock(self):
    if self.handle:
      fcntl.flock(self.handle, fcntl.LOCK_UN)
      self.handle.close()
      self.handle = None

  def _remove_unfinished_saves(self):
    """orbax writes a save into `N.orbax-checkpoint-tmp*` and renames it when complete: one left there is a save a
    killed run never finished. Only the holder of the lock may remove them (a reader cannot tell them from saves
    in progress)."""
    unfinished = sorted(self.out.glob(f"checkpoints/*{UNFINISHED_SAVE}*"))
    for path in unfinished:
      shutil.rmtree(path)
    if unfinished:
      print(f"removed the unfinished checkpoint saves a killed run left in {self.out / 'checkpoints'}: "
            f"{', '.join(p.name for p in unfinished)}", flush=True)

  def _check_fresh(self):
    if self.resume:
      return
    steps = checkpoint_steps(self.out / "checkpoints")
    outputs = [name for name in RUN_OUTPUTS if name != "checkpoints" and (self.out / name).exists()]
    if not steps and not outputs:
      return
    held = f"checkpoint step {steps[-1]}" if steps else f"{', '.join(outputs)}, no checkpoint"
    if not self.overwrite:
      resume = "continue it with --resume, or " if steps else "it has no checkpoint to --resume from; "
      raise RunDirectoryError(f"{self.out} holds an earlier run ({held}); {resume}start over with --overwrite "
                              f"(deletes its {', '.join(RUN_OUTPUTS)}), or train into another directory with --out "
                              "DIR")
    removed = [name for name in RUN_OUTPUTS if (self.out / name).exists()]
    for name in removed:
      path = self.out / name
      if path.is_dir():
        shutil.rmtree(path)
      else:
        path.unlink()
    print(f"--overwrite: removed the earlier run ({held}) from {self.out}: {', '.join(removed)}", flush=True)


def _same_file(handle, path):
  try:
    return os.fstat(handle.fileno()).st_ino == os.stat(path).st_ino
  except FileNotFoundError:
    return False


def _reason(err):
  """'Read-only file system: /x' from an OSError: what the OS said, and of what."""
  return f"{err.strerror}: {err.filename}" if err.strerror and err.filename else str(err)


def keep_metrics_before(path, step):
  """Drops the rows of metrics.jsonl for steps ≥ `step` (a resumed run logs them again) and any row cut short by a
  killed run."""
  path = pathlib.Path(path)
  if not path.exists():
    return
  lines = path.read_text().splitlines(keepends=True)
  kept = [line for line in lines if _step_of(line) is not None and _step_of(line) < step]
  if len(kept) != len(lines):
    path.write_text("".join(kept))


def _step_of(line):
  try:
    return json.loads(line)["step"]
  except (ValueError, KeyError, TypeError):
    return None
