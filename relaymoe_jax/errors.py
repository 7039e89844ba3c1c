"""The project's own errors for bad input: raised only where the message is written for whoever gave the input, so
the command-line tools print them as one line and anything else (JAX's errors included, whose tracebacks JAX trims
to the caller's frames) as a bug with its traceback."""

import jax
import numpy as np


class UserError(ValueError):
  """Bad input, named in the message; a ValueError, so callers that catch ValueError keep working."""


class MissingInput(UserError, FileNotFoundError):
  """A file or directory the user named is not there (also a FileNotFoundError)."""


def check_ids_in_range(ids_XK, upper, name, what):
  """Rejects ids outside [0, upper) where their values are known: not traced, and every shard on this process.
  (Traced ids cannot be checked; the callers make such an id contribute nothing or NaN.)"""
  if isinstance(ids_XK, jax.core.Tracer) or not getattr(ids_XK, "is_fully_addressable", True):
    return
  ids = np.asarray(ids_XK)
  bad = np.argwhere((ids < 0) | (ids >= upper))
  if bad.size:
    row, col = bad[0]
    more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
    raise UserError(f"{name}[{row}, {col}] = {ids[row, col]} is not {what} in [0, {upper}){more}")
