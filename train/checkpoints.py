"""Training checkpoints: orbax saves of {state, meta}, and restores that skip what does not read and name what does
not fit."""

import pathlib
import sys

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils


class Checkpoints:
  """orbax CheckpointManager: async saves of {state, meta}; a save is atomic (written aside, then renamed), so a
  crash mid-save leaves the previous checkpoint as the latest. A context manager: leaving it waits for the last
  save and closes orbax's threads, on errors too."""

  def __init__(self, directory, keep):
    self.directory = pathlib.Path(directory).absolute()
    self.manager = ocp.CheckpointManager(
        self.directory, item_handlers=dict(state=ocp.StandardCheckpointHandler(), meta=ocp.JsonCheckpointHandler()),
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=True))

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  def save(self, step, state, meta):
    self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                    meta=ocp.args.JsonSave(meta)))

  def latest_step(self):
    return self.manager.latest_step()

  def restore(self, like_state, step=None):
    """(state, meta) of the newest checkpoint that restores into `like_state`'s shapes and shardings (or of
    checkpoint `step`).

    A checkpoint of another layout (layers, sizes, `runtime.scan_layers`) is an error, read from its metadata before
    any array. A checkpoint whose files do not read (truncated, corrupted) is skipped for the next older one and
    moved aside to `checkpoints-unreadable/`, never deleted, so that this run's saves can take its step again.
    """
    steps = sorted(self.manager.all_steps(), reverse=True)
    if not steps:
      raise FileNotFoundError(f"--resume: no checkpoint in {self.directory}")
    if step is not None:
      if step not in steps:
        raise FileNotFoundError(f"no checkpoint of step {step} in {self.directory}; there are {sorted(steps)}")
      steps = [step]
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), like_state)
    _quiet_closed_event_loops()
    unreadable = []
    for step in steps:
      try:
        restored = self._restore_step(step, abstract)
      except CheckpointUnreadable as err:
        unreadable.append((step, err))
        continue
      self._set_aside(unreadable, step)
      return restored
    raise CheckpointUnreadable(f"--resume: no checkpoint in {self.directory} restores: " + "; ".join(
        f"step {step}: {err}" for step, err in unreadable))

  def _restore_step(self, step, abstract):
    try:
      stored = self.manager.item_metadata(step)["state"]
    except (ValueError, KeyError, OSError) as err:
      raise CheckpointUnreadable(f"its metadata does not read ({_first_line(err)})") from err
    if stored is None:
      raise CheckpointUnreadable("it has no training state")
    names = _names_in(stored, abstract)
    wanted = _renamed(abstract, {new: old for old, new in names.items()})
    if _leaf_shapes(stored) != _leaf_shapes(wanted):
      # Checked before orbax reads any array: a read of the wrong shape fails inside tensorstore and floods stderr.
      raise ValueError(f"--resume: checkpoint step {step} in {self.directory} does not fit this model's "
                       "parameters (another model config: layers, sizes, or runtime.scan_layers, which stacks "
                       f"layers); {_layout_difference(_leaf_shapes(stored), _leaf_shapes(abstract))}")
    try:
      restored = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(wanted),
                                                                    meta=ocp.args.JsonRestore()))
    except (ValueError, KeyError, OSError) as err:  # the layout matched: its files are what is wrong
      raise CheckpointUnreadable(f"it does not read ({_first_line(err)})") from err
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
        print(f"--resume: skipped checkpoint step {step}: {err}; moved it to {target} (kept) and resuming from "
              f"step {good_step}", file=sys.stderr, flush=True)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices("relaymoe: unreadable checkpoints set aside")
    self.manager.reload()

  def close(self):
    if self.manager is None:
      return
    manager, self.manager = self.manager, None
    manager.wait_until_finished()
    manager.close()


class CheckpointUnreadable(RuntimeError):
  """A checkpoint's files do not read (truncated, corrupted, missing)."""


# Parameters renamed since checkpoints were first written, {old: new}: the shared expert's width took the letter
# F of every SwiGLU's (it was S, which is the sequence). A checkpoint with the old names restores under the new.
RENAMED = {"shared_gate_DS": "shared_gate_DF", "shared_up_DS": "shared_up_DF", "shared_down_SD": "shared_down_FD"}


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


def _first_line(err):
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
  """When one read of a checkpoint fails, orbax closes its event loop with reads still in flight, and each of
  tensorstore's late callbacks prints an 'Event loop is closed' traceback (hundreds, burying the real error):
  drop those, and only those, from then on."""
  previous = sys.unraisablehook
  if getattr(previous, "relaymoe_quiet", False):
    return

  def hook(unraisable):
    if not (isinstance(unraisable.exc_value, RuntimeError) and "Event loop is closed" in str(unraisable.exc_value)):
      previous(unraisable)

  hook.relaymoe_quiet = True
  sys.unraisablehook = hook
