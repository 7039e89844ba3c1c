"""Training batches [B, S+1] of int32 tokens, deterministic in the step number, so a resumed run continues exactly.

Sources: a built-in synthetic language (no download; its loss floor is known), memory-mapped pre-tokenised .bin
files (uint16/uint32, the common format), and UTF-8 text, read as bytes or tokenised with a tokenizer.json into a
cached .bin (`train.text`).
"""

import math
import pathlib

import jax
import numpy as np
from jax.experimental import multihost_utils

from train.text import TokenizedText


class SyntheticLanguage:
  """A random first-order language: each token has `branching` successors, drawn uniformly.

  Given the previous token the next is uniform over its successors, so the best achievable cross-entropy on every
  predicted token is exactly ln(branching) nats (`entropy_floor`); a model starts near ln(vocab).
  """

  def __init__(self, vocab_size, branching, seed):
    if not 1 <= branching <= vocab_size:
      raise ValueError(f"branching={branching} must be between 1 and vocab_size={vocab_size}")
    rng = np.random.default_rng(seed)
    self.vocab_size, self.seed = vocab_size, seed
    self.successors = np.stack([rng.choice(vocab_size, branching, replace=False) for _ in range(vocab_size)])
    self.entropy_floor = math.log(branching)

  def batch(self, step, batch_size, seq_len):
    rng = np.random.default_rng([self.seed, step])
    tokens = np.empty((batch_size, seq_len + 1), np.int32)
    tokens[:, 0] = rng.integers(self.vocab_size, size=batch_size)
    choices = rng.integers(self.successors.shape[1], size=(batch_size, seq_len))
    for s in range(seq_len):
      tokens[:, s + 1] = self.successors[tokens[:, s], choices[:, s]]
    return tokens


class TokenWindows:
  """Consecutive windows of S+1 tokens (stride S) over a 1-D token array, batch after batch, wrapping around."""

  entropy_floor = None

  def __init__(self, tokens, vocab_size):
    self.tokens = tokens
    if tokens.size and int(tokens.max()) >= vocab_size:
      raise ValueError(f"token id {int(tokens.max())} is out of range for vocab_size={vocab_size}")

  def batch(self, step, batch_size, seq_len):
    windows = (self.tokens.size - 1) // seq_len
    if windows < 1:
      raise ValueError(f"{self.tokens.size} tokens are too few for one window of seq_len+1={seq_len + 1}")
    starts = ((step * batch_size + np.arange(batch_size)) % windows) * seq_len
    return np.stack([self.tokens[s:s + seq_len + 1] for s in starts]).astype(np.int32)


def make_source(data_config, vocab_size):
  kind = data_config.kind
  if kind == "synthetic":
    return SyntheticLanguage(vocab_size, data_config.branching, data_config.seed)
  path = pathlib.Path(data_config.path)
  if not path.exists():
    raise ValueError(f"data.path {str(path)!r} does not exist")
  if kind == "tokens":
    return TokenWindows(np.memmap(path, dtype=data_config.token_dtype, mode="r"), vocab_size)
  if data_config.tokenizer:
    return _tokenized_text(data_config, vocab_size)
  if vocab_size < 256:
    raise ValueError(f"text data is byte-level and needs vocab_size ≥ 256; the model has {vocab_size}")
  return TokenWindows(np.frombuffer(path.read_bytes(), dtype=np.uint8), vocab_size)


def _tokenized_text(data_config, vocab_size):
  """Windows over the text's cached tokens: process 0 tokenises (when the cache is missing), the others wait for it."""
  text = TokenizedText(data_config)
  if jax.process_index() == 0:
    text.build()
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices("relaymoe: tokenized text cached")
    if not text.cache.exists():
      raise ValueError(f"process {jax.process_index()} does not see the tokenised cache {text.cache} that process 0 "
                       "wrote: put data.cache_dir on a filesystem all processes share")
  try:
    return TokenWindows(text.tokens(), vocab_size)
  except ValueError as err:
    raise ValueError(f"{err} (the tokenizer {data_config.tokenizer} has {text.vocab_size} ids: set "
                     f"model.vocab_size ≥ {text.vocab_size})") from None
