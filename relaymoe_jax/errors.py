"""The project's own errors for bad input: raised only where the message is written for whoever gave the input, so
the command-line tools print them as one line and anything else (JAX's errors included, whose tracebacks JAX trims
to the caller's frames) as a bug with its traceback."""


class UserError(ValueError):
  """Bad input, named in the message; a ValueError, so callers that catch ValueError keep working."""


class MissingInput(UserError, FileNotFoundError):
  """A file or directory the user named is not there (also a FileNotFoundError)."""
