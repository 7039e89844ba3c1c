"""Training checkpoints: orbax saves of {state, meta} (logged with their size and time; a full disk named in one
line), and restores that skip what does not read (truncated, corrupted: checked against checksums taken at save)
and name what does not fit."""

import contextlib
import errno
import logging
import pathlib
import shutil
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from relaymoe_jax.errors import MissingInput, UserError
from train.metrics import log_on_process_0, size
from train.rundir.directory import checkpoint_steps


class Checkpoints:
  """orbax CheckpointManager: async saves of {state, meta}; a save is atomic (written aside, then renamed), so a
  crash mid-save leaves the previous checkpoint as the latest. A context manager: leaving it waits for the last
  save and closes orbax's threads, on errors too."""

  def __init__(self, directory, keep):
    self.directory = pathlib.Path(directory).absolute()
    self.manager = ocp.CheckpointManager(
        self.directory, item_handlers=dict(state=ocp.StandardCheckpointHandler(), meta=ocp.JsonCheckpointHandler()),
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=True))
    self.pending = None  # (step, bytes, start time) of the save in flight
    self.last_saved = None
    _quiet_closed_event_loops()
    self.log_filter = _DiskFullLogFilter()
    for logger in LOGGERS:
      logging.getLogger(logger).addFilter(self.log_filter)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  def save(self, step, state, meta):
    """Starts an async save of `state` (after the previous save has finished), `meta` with the state's checksums.

    Raises CheckpointSaveFailed, naming the directory, the bytes needed and the last good checkpoint, when the disk
    is full (here or when the save finishes: `poll`, `close`)."""
    self.finish()
    nbytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
    meta = dict(meta, checksums=checksums(state))
    log_on_process_0(f"saving checkpoint step {step} ({size(nbytes)}) to {self.directory}")
    self.pending = (step, nbytes, time.perf_counter())
    with _reporting_disk_full(self):
      self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                      meta=ocp.args.JsonSave(meta)))

  def poll(self):
    """Says so when the save in flight has finished (called at each step; never waits)."""
    if self.pending and not self.manager.is_saving_in_progress():
      self.finish()

  def finish(self):
    """Waits for the save in flight, then logs its end with its size and time."""
    if not self.pending:
      return
    with _reporting_disk_full(self):
      self.manager.wait_until_finished()
    step, nbytes, start = self.pending
    self.pending, self.last_saved = None, step
    log_on_process_0(f"saved checkpoint step {step} ({size(nbytes)}) in {time.perf_counter() - start:.1f} s")

  @property
  def failed(self):
    """Whether a save failed for a full disk (reported once; orbax's threads fail on until exit)."""
    return self.log_filter.failed

  def latest_step(self):
    return self.manager.latest_step()

  def restore(self, like_state, step=None, set_aside=True):
    """(state, meta) of the newest checkpoint that restores into `like_state`'s shapes and shardings (or of
    checkpoint `step`).

    A checkpoint of another layout (layers, sizes, `runtime.scan_layers`) is an error, read from its metadata before
    any array. A checkpoint whose files do not read (truncated, corrupted) is skipped for the next older one and
    moved aside to `checkpoints-unreadable/`, never deleted, so that this run's saves can take its step again;
    `set_aside=False` (another run's checkpoints, read as a source) leaves it where it is.
    """
    steps = sorted(self.manager.all_steps(), reverse=True)
    if not steps:
      raise MissingInput(f"no checkpoint in {self.directory}")
    if step is not None:
      if step not in steps:
        raise MissingInput(f"no checkpoint of step {step} in {self.directory}; there are {sorted(steps)}")
      steps = [step]
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), like_state)
    unreadable = []
    for step in steps:
      try:
        restored = self._restore_step(step, abstract)
      except CheckpointUnreadable as err:
        unreadable.append((step, err))
        continue
      if set_aside:
        self._set_aside(unreadable, step)
      else:
        _say_skipped(self.directory, unreadable, step, "left in place: a source is read, not changed")
      return restored
    raise CheckpointUnreadable(f"no checkpoint in {self.directory} restores: " + "; ".join(
        f"step {step}: {err}" for step, err in unreadable))

  def _restore_step(self, step, abstract):
    try:
      stored = self.manager.item_metadata(step)["state"]
    except Exception as err:
      if not read_failure(err):
        raise
      raise CheckpointUnreadable(f"its metadata does not read ({first_line(err)})") from err
    if stored is None:
      raise CheckpointUnreadable("it has no training state")
    names = _names_in(stored, abstract)
    wanted = _renamed(abstract, {new: old for old, new in names.items()})
    if _leaf_shapes(stored) != _leaf_shapes(wanted):
      # Checked before orbax reads any array: a read of the wrong shape fails inside tensorstore and floods stderr.
      raise UserError(f"--resume: checkpoint step {step} in {self.directory} does not fit this model's "
                      "parameters (another model config: layers, sizes, or runtime.scan_layers or runtime.remat, "
                      "which decide how layers stack); "
                      f"{_layout_difference(_leaf_shapes(stored), _leaf_shapes(abstract))}")
    try:
      restored = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(wanted),
                                                                    meta=ocp.args.JsonRestore()))
    except Exception as err:  # the layout matched: its files are what is wrong, if orbax failed reading them
      if not read_failure(err):
        raise
      raise CheckpointUnreadable(f"its arrays do not read ({first_line(err)})") from err
    # A flipped bit in zstd-compressed data can decode to other numbers without an error.
    saved = (restored.meta or {}).get("checksums")
    if saved is not None:
      differ = sorted(k for k, v in checksums(restored.state).items() if saved.get(k) != v)
      if differ:
        raise CheckpointUnreadable(f"{len(differ)} arrays do not match their checksums (first: {differ[0]})")
    return restored.state if not names else _renamed(restored.state, names), restored.meta

  def _set_aside(self, unreadable, good_step):
    """Moves the unreadable checkpoints out of orbax's sight (process 0; all processes then see it) and says so."""
    if not unreadable:
      return
    aside = self.directory.parent / "checkpoints-unreadable"
    for step, err in unreadable:
      target = aside / str(step)
      if jax.process_index() == 0:
        aside.mkdir(exist_ok=True)
        while target.exists():
          target = target.with_name(target.name + "+")
        (self.directory / str(step)).rename(target)
        _say_skipped(self.directory, [(step, err)], good_step, f"moved it to {target} (kept)")
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices("relaymoe: unreadable checkpoints set aside")
    self.manager.reload()

  def close(self):
    if self.manager is None:
      return
    try:
      if not self.failed:
        self.finish()
    finally:
      manager, self.manager = self.manager, None
      try:
        manager.close()
      except Exception:
        if not self.failed:  # a failed save was reported once already; orbax raises it again here
          raise
      finally:
        if not self.failed:  # after a failure orbax's threads go on failing until the process exits
          for logger in LOGGERS:
            logging.getLogger(logger).removeFilter(self.log_filter)


class CheckpointSaveFailed(OSError):
  """A checkpoint could not be saved: the disk is full."""


class CheckpointUnreadable(RuntimeError):
  """A checkpoint's files do not read (truncated, corrupted, missing)."""


# Parameters renamed since checkpoints were first written, {old: new}: the shared expert's width took the letter
# F of every SwiGLU's (it was S, which is the sequence). A checkpoint with the old names restores under the new.
RENAMED = {"shared_gate_DS": "shared_gate_DF", "shared_up_DS": "shared_up_DF", "shared_down_SD": "shared_down_FD"}


def _say_skipped(directory, unreadable, good_step, what_became_of_it):
  if jax.process_index() == 0:
    for step, err in unreadable:
      print(f"skipped checkpoint step {step} in {directory}: {err}; {what_became_of_it}; using step {good_step}",
            file=sys.stderr, flush=True)


def _names_in(stored, abstract):
  """The renames (`RENAMED`) that map the stored checkpoint's names onto this model's: those it uses."""
  stored_keys = {k for key in _leaf_shapes(stored) for k in key.split(".")}
  wanted_keys = {k for key in _leaf_shapes(abstract) for k in key.split(".")}
  return {old: new for old, new in RENAMED.items() if old in stored_keys and new in wanted_keys}


def _renamed(tree, names):
  """`tree` with every dict key in `names` renamed; named tuples, tuples and lists kept as they are."""
  if not names:
    return tree
  if isinstance(tree, dict):
    return {names.get(k, k): _renamed(v, names) for k, v in tree.items()}
  if isinstance(tree, tuple) and hasattr(tree, "_fields"):
    return type(tree)(*(_renamed(v, names) for v in tree))
  if isinstance(tree, (tuple, list)):
    return type(tree)(_renamed(v, names) for v in tree)
  return tree


@jax.jit
def _bits_sum(x):
  """The wrapping uint32 sum of an array's elements' bits (a flipped bit always changes it)."""
  if x.dtype == jnp.bool_:
    x = x.astype(jnp.uint8)
  unsigned = jnp.dtype(f"uint{8 * x.dtype.itemsize}")
  return jnp.sum(jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32), dtype=jnp.uint32)


def _checksums(state):
  """Per array, `_bits_sum`, each where the array lives (a state may hold arrays on different devices)."""
  return jax.tree.map(_bits_sum, state)


def checksums(state):
  """{array name (as `_leaf_shapes` names it): checksum} of a state's arrays, the same on every process."""
  sums = _checksums(state)
  return {name: int(np.asarray(sums_leaf.addressable_data(0))) for name, sums_leaf in zip(
      _leaf_shapes(state), jax.tree.leaves(sums))}


@contextlib.contextmanager
def _reporting_disk_full(checkpoints):
  """A full disk in what runs inside becomes one CheckpointSaveFailed naming the bytes and the last good
  checkpoint; other errors pass unchanged."""
  step, nbytes, _ = checkpoints.pending
  good = [s for s in checkpoint_steps(checkpoints.directory) if s < step]
  with naming_a_full_disk(checkpoints.log_filter, checkpoints.directory, f"save checkpoint step {step}", nbytes,
                          f"the last good checkpoint is step {good[-1]} in {checkpoints.directory}" if good else
                          "there is no good checkpoint yet"):
    yield


@contextlib.contextmanager
def naming_a_full_disk(log_filter, directory, what, nbytes, then):
  """A full disk in what runs inside becomes one CheckpointSaveFailed, `no space left on the device of DIRECTORY
  to WHAT: it needs ... bytes are free; THEN`, and `log_filter` drops orbax's logs from then on; other errors pass
  unchanged."""
  try:
    yield
  except Exception as err:
    if not any(_disk_full(e) for e in _chain(err)):
      raise
    log_filter.failed = True
    free = shutil.disk_usage(directory if directory.exists() else directory.parent).free
    raise CheckpointSaveFailed(
        f"no space left on the device of {directory} to {what}: it needs up to {size(nbytes)} ({nbytes} bytes) "
        f"and {free} bytes are free; {then}") from err


def save_params(directory, params):
  """`params` as one orbax checkpoint in `directory` (`relaymoe-convert hf-to-orbax`); a full disk is one
  CheckpointSaveFailed naming the bytes, not the tracebacks of orbax's threads."""
  _quiet_closed_event_loops()
  log_filter = _DiskFullLogFilter()
  nbytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
  for logger in LOGGERS:
    logging.getLogger(logger).addFilter(log_filter)
  try:
    with naming_a_full_disk(log_filter, directory, "write the parameters", nbytes,
                            "nothing usable was written: free space and run it again"):
      with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(directory, params)
  finally:
    if not log_filter.failed:  # after a failure orbax's threads go on failing until the process exits
      for logger in LOGGERS:
        logging.getLogger(logger).removeFilter(log_filter)


def _disk_full(err):
  """An OSError of a full disk or quota, or tensorstore's ValueError that wraps one."""
  if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
    return True
  return isinstance(err, ValueError) and any(text in str(err) for text in DISK_FULL_TEXTS)


# How orbax begins the bare Exception it raises for an array that does not read.
ORBAX_READ_FAILED = "Encountered error while reading array index"
# How tensorstore words a full disk inside its errors (the OS's message and its errno 28).
DISK_FULL_TEXTS = ("No space left on device", "os_error_code='28'", "Disk quota exceeded")


# Where orbax's threads, and asyncio for their abandoned futures, log their failures.
LOGGERS = ("absl", "asyncio")


class _DiskFullLogFilter(logging.Filter):
  """Drops the logged tracebacks of a full disk (each of orbax's threads logs one, hundreds of lines), and once a
  save failed (`CheckpointSaveFailed` says it in one line: `failed`) the errors of orbax's threads that go on
  until exit."""

  def __init__(self):
    super().__init__()
    self.failed = False

  def filter(self, record):
    if self.failed:
      return False
    return not any(text in record.getMessage() or text in str(record.exc_info and record.exc_info[1])
                   for text in DISK_FULL_TEXTS)


def read_failure(err):
  """Whether orbax failed reading a checkpoint's files (tensorstore's ValueError, an OSError, a missing key), which
  it may wrap in a bare Exception, rather than a bug of the caller's."""
  if isinstance(err, (ValueError, KeyError, OSError)):
    return True
  frames = traceback.extract_tb(err.__traceback__)
  from_orbax = bool(frames) and "orbax" in pathlib.Path(frames[-1].filename).parts
  return type(err) is Exception and from_orbax and any(
      isinstance(e, (ValueError, KeyError, OSError)) for e in _chain(err))


def _chain(err):
  seen = []
  while err is not None and err not in seen:
    seen.append(err)
    err = err.__cause__ or err.__context__
  return seen


def first_line(err):
  """The first line of the innermost error under `err` (orbax wraps tensorstore's, which says what is wrong)."""
  err = _chain(err)[-1]
  return (str(err).strip().splitlines() or [type(err).__name__])[0][:300]


def _leaf_shapes(tree):
  """{'opt_state.1.0.mu.embed_VD': shape} for every array: the same keys for a saved tree's metadata (dicts and
  lists) and the live one (named tuples, tuples)."""
  def name(key):
    return str(getattr(key, "key", getattr(key, "idx", getattr(key, "name", key))))
  return {".".join(name(k) for k in path): tuple(leaf.shape) for path, leaf in jax.tree_util.tree_leaves_with_path(
      tree, is_leaf=lambda x: hasattr(x, "shape"))}


def _layout_difference(stored, wanted):
  only_stored, only_wanted = sorted(set(stored) - set(wanted)), sorted(set(wanted) - set(stored))
  if only_stored or only_wanted:
    return (f"the checkpoint has {len(only_stored)} arrays this model lacks (first: {only_stored[:2]}) and lacks "
            f"{len(only_wanted)} it has (first: {only_wanted[:2]})")
  key = next(k for k in sorted(stored) if stored[k] != wanted[k])
  return f"{key} is {stored[key]} in the checkpoint and {wanted[key]} in this model"


def _quiet_closed_event_loops():
  """When one read or write of a checkpoint fails, orbax closes its event loop with others still in flight, and
  each of tensorstore's late callbacks prints an 'Event loop is closed' traceback, and each abandoned read its
  failure again (hundreds, burying the real error): drop those, and only those, from then on."""
  previous = sys.unraisablehook
  if getattr(previous, "relaymoe_quiet", False):
    return

  def hook(unraisable, read_failed=ORBAX_READ_FAILED):  # bound now: at exit the module's globals may be gone
    err = unraisable.exc_value
    if not (isinstance(err, RuntimeError) and "Event loop is closed" in str(err)
            or type(err) is Exception and str(err).startswith(read_failed)
            or isinstance(err, ImportError) and "Python is likely shutting down" in str(err)):
      previous(unraisable)

  hook.relaymoe_quiet = True
  sys.unraisablehook = hook
