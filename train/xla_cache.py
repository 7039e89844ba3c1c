"""JAX's persistent compilation cache for the command-line tools: where it is, and what happens to an entry that
does not read. JAX warns (`Error reading persistent compilation cache entry for 'jit_step'`, no file named),
compiles, and never replaces the entry (its cache does not overwrite a key it holds), so a damaged entry was
compiled again on every run, forever. Here such an entry is named and removed, and the compile that follows
caches the step anew."""

import contextlib
import functools
import pathlib
import sys

import jax
from jax._src import compilation_cache

# How JAX's file cache names an entry's file (jax._src.lru_cache), and the file of its last access time.
ENTRY_SUFFIXES = ("-cache", "-atime")


def use_compilation_cache(directory):
  """JAX's persistent compilation cache in `directory`, its damaged entries removed (named on stderr) as they are
  read. Before anything compiles: JAX reads the directory once."""
  jax.config.update("jax_compilation_cache_dir", directory)
  read = compilation_cache.get_executable_and_time
  compilation_cache.get_executable_and_time = dropping_damaged_entries(
      getattr(read, "relaymoe_unwrapped", read), pathlib.Path(directory))  # once, whatever the directory


@contextlib.contextmanager
def compiled_afresh(on=True):
  """Programs compiled inside (with `on`) are compiled, not read from JAX's persistent cache (they are still
  written to it): a cache read is a miss."""
  read = compilation_cache.get_executable_and_time
  if on:
    compilation_cache.get_executable_and_time = lambda *args, **kwargs: (None, None)
  try:
    yield
  finally:
    compilation_cache.get_executable_and_time = read


def dropping_damaged_entries(read, directory):
  """`read(cache_key, ...)` (JAX's cache read of the cache in `directory`), which on failure first removes the
  entry's files, saying so."""

  @functools.wraps(read)
  def read_or_drop(cache_key, *args, **kwargs):
    try:
      return read(cache_key, *args, **kwargs)
    except Exception as err:
      _drop(directory, cache_key, err)
      raise  # JAX warns and compiles

  read_or_drop.relaymoe_unwrapped = read
  return read_or_drop


def _drop(directory, cache_key, err):
  entry = directory / f"{cache_key}{ENTRY_SUFFIXES[0]}"
  why = f"{type(err).__name__}: {str(err)[:200]}"
  try:
    if not entry.exists():  # not a local file: a remote cache (gs://...)
      raise FileNotFoundError("not a file on this machine")
    for suffix in ENTRY_SUFFIXES:
      (directory / f"{cache_key}{suffix}").unlink(missing_ok=True)
  except OSError as e:
    print(f"warning: the compilation cache entry {entry} does not read ({why}) and could not be removed "
          f"({e.strerror or e}): delete it, or every run compiles this step again", file=sys.stderr, flush=True)
    return
  print(f"warning: removed the compilation cache entry {entry}, which does not read ({why}): compiled again and "
        "cached anew", file=sys.stderr, flush=True)
