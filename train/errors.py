"""How the command-line tools end: errors a user can act on as one line and an exit status, bugs with their
traceback. Shared by `relaymoe-train`, `relaymoe-plan` and `relaymoe-convert`."""

import pathlib
import sys
import traceback

from train.checkpoints import CheckpointSaveFailed, CheckpointUnreadable
from train.compile import StepDoesNotFit
from train.metrics import LogWriteFailed
from train.preempt import Stopped
from train.rundir import RunDirectoryError


def run_cli(prog, args, body):
  """body(args), with the errors a user can act on printed as one line and turned into an exit status."""
  try:
    body(args)
  except KeyboardInterrupt:
    print(f"{prog}: interrupted; nothing saved since the last checkpoint", file=sys.stderr)
    sys.exit(130)
  except Exception as err:
    status = exit_status(err)
    if status is None or args.debug:
      raise
    print(f"{prog}: {'' if status > 128 else 'error: '}{err}", file=sys.stderr)
    sys.exit(status)


def exit_status(err):
  """The exit status of an error the user can act on from its message alone; None for a bug (a traceback)."""
  if isinstance(err, Stopped):
    return err.exit_status
  if isinstance(err, (FloatingPointError, CheckpointSaveFailed, LogWriteFailed)):  # failed while training
    return 1
  if isinstance(err, (RunDirectoryError, CheckpointUnreadable, StepDoesNotFit)):
    return 2
  if isinstance(err, (ValueError, FileNotFoundError)) and _raised_here(err):
    return 2
  return None


def _raised_here(err):
  """True when this project raised err itself (its message is written for users), not JAX or a library below."""
  root = pathlib.Path(__file__).resolve().parents[1]
  raiser = pathlib.Path(traceback.extract_tb(err.__traceback__)[-1].filename).resolve()
  return any(raiser.is_relative_to(root / package) for package in ("train", "models", "relaymoe_jax"))
