"""How the command-line tools end: errors a user can act on as one line and an exit status, bugs with their
traceback and a line saying so. Shared by `relaymoe-train`, `relaymoe-plan` and `relaymoe-convert`."""

import sys
import traceback

from relaymoe_jax.errors import UserError
from train.rundir.checkpoints import CheckpointSaveFailed, CheckpointUnreadable
from train.compile import StepDoesNotFit
from train.data.batches import DataChanged
from train.metrics import LogWriteFailed
from train.rundir.preempt import Stopped
from train.rundir.directory import RunDirectoryError

BUG_STATUS = 1


def run_cli(prog, args, body):
  """body(args), with the errors a user can act on printed as one line and turned into an exit status."""
  try:
    body(args)
  except KeyboardInterrupt:
    print(f"{prog}: interrupted; nothing saved since the last checkpoint", file=sys.stderr)
    sys.exit(130)
  except Exception as err:
    status = exit_status(err)
    if args.debug:
      raise
    if status is None:
      traceback.print_exc()
      print(f"{prog}: this is a bug, not a problem with the input: please report it with the traceback above "
            "(--debug is not needed to see it)", file=sys.stderr)
      sys.exit(BUG_STATUS)
    print(f"{prog}: {'' if status > 128 else 'error: '}{err}", file=sys.stderr)
    sys.exit(status)


def exit_status(err):
  """The exit status of an error the user can act on from its message alone; None for a bug (a traceback).

  By class, never by where it was raised: JAX trims its own frames from tracebacks, so its errors raised while
  tracing this project's code look raised by it."""
  if isinstance(err, Stopped):
    return err.exit_status
  if isinstance(err, (FloatingPointError, CheckpointSaveFailed, LogWriteFailed, DataChanged)):  # failed training
    return 1
  if isinstance(err, (UserError, RunDirectoryError, CheckpointUnreadable, StepDoesNotFit)):
    return 2
  return None
