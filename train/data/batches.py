"""Training batches [B, S+1] of int32 tokens, deterministic in the step number, so a resumed run continues exactly.

Sources: a built-in synthetic language (no download; its loss floor is known), memory-mapped pre-tokenised .bin
files (uint16/uint32, the common format), and UTF-8 text, read as bytes or tokenised with a tokenizer.json into a
cached .bin (`train.data.text`). A source whose documents end in an EOS id (`eos`, None where none is known) gives each
batch, with `data.document_masking`, its documents' segment ids and positions (`documents`, as levanter derives
them); the held-out batches come from `make_sources`.
"""

import codecs
import copy
import dataclasses
import datetime
import math
import os
import pathlib

import jax
import numpy as np
from jax.experimental import multihost_utils

from relaymoe_jax.errors import UserError
from train.data.text import TokenizedText


class SyntheticLanguage:
  """A random first-order language: each token has `branching` successors, drawn uniformly.

  Given the previous token the next is uniform over its successors, so the best achievable cross-entropy on every
  predicted token is exactly ln(branching) nats (`entropy_floor`); a model starts near ln(vocab).
  """

  eos = None

  def __init__(self, vocab_size, branching, seed, held_out=False):
    if not 1 <= branching <= vocab_size:
      raise UserError(f"data.branching={branching} must be between 1 and model.vocab_size={vocab_size}")
    rng = np.random.default_rng(seed)
    self.vocab_size, self.seed = vocab_size, seed
    self.stream = [1] if held_out else []  # held-out samples: another random stream of the same language
    self.successors = np.stack([rng.choice(vocab_size, branching, replace=False) for _ in range(vocab_size)])
    self.entropy_floor = math.log(branching)

  def batch(self, step, batch_size, seq_len):
    rng = np.random.default_rng([self.seed, step, *self.stream])
    tokens = np.empty((batch_size, seq_len + 1), np.int32)
    tokens[:, 0] = rng.integers(self.vocab_size, size=batch_size)
    choices = rng.integers(self.successors.shape[1], size=(batch_size, seq_len))
    for s in range(seq_len):
      tokens[:, s + 1] = self.successors[tokens[:, s], choices[:, s]]
    return tokens


SCAN_TOKENS = 1 << 28  # the most tokens `most_documents` reads (a second or so): the first windows of a larger run
READ_TOKENS = 1 << 24  # tokens it reads at a time


class DataChanged(UserError):
  """The data file changed under the run (ids out of range, or shorter): the run stops at the step that met it."""


class TokenWindows:
  """Consecutive windows of S+1 tokens (stride S) over a 1-D token array, batch after batch, wrapping around."""

  entropy_floor = None
  batch_name = "step"  # what a batch's number is, in errors: a training step, or a held-out batch

  def __init__(self, tokens, vocab_size, seq_len=None, where="the data", eos=None):
    """`seq_len` given: a source too short for one window is refused now, not at the first step."""
    self.tokens, self.num_tokens, self.where, self.eos = tokens, tokens.size, where, eos
    self.first = 0  # where `tokens` start in the file (`part`)
    if tokens.size and int(tokens.max()) >= vocab_size:
      raise UserError(f"token id {int(tokens.max())} is out of range for model.vocab_size={vocab_size}")
    self._check_length(seq_len)

  def _check_length(self, seq_len):
    if seq_len is not None and (self.num_tokens - 1) // seq_len < 1:
      raise UserError(f"{self.where} holds {self.num_tokens} tokens, too few for one window of seq_len+1="
                      f"{seq_len + 1}")

  def part(self, start, stop, seq_len, where):
    """Tokens [start, stop) of this source as a source of its own, read as this one reads (a token file: from the
    file, so that it too notices the file shrinking), its ids checked already."""
    part = copy.copy(self)
    part.tokens, part.num_tokens, part.where = self.tokens[start:stop], stop - start, where
    part.first = self.first + start
    part._check_length(seq_len)
    return part

  def batch(self, step, batch_size, seq_len):
    windows = (self.num_tokens - 1) // seq_len
    if windows < 1:
      raise UserError(f"{self.num_tokens} tokens are too few for one window of seq_len+1={seq_len + 1}")
    starts = ((step * batch_size + np.arange(batch_size)) % windows) * seq_len
    return np.stack(self.windows(starts, seq_len + 1, step)).astype(np.int32)

  def windows(self, starts, length, step):
    return [self.tokens[s:s + length] for s in starts]

  def most_documents(self, seq_len, windows=None, scan=SCAN_TOKENS):
    """The most documents the inputs of one of the first `windows` windows (all where None; no more than `scan`
    tokens' worth) hold: 1 + the EOS ids before a window's last input; None without an EOS id."""
    if self.eos is None:
      return None
    n = min((self.num_tokens - 1) // seq_len, windows or self.num_tokens, max(1, scan // seq_len))
    per_read = max(1, READ_TOKENS // seq_len)
    most = 1
    for first in range(0, n, per_read):
      count = min(per_read, n - first)
      inputs = np.asarray(self.tokens[first * seq_len:(first + count) * seq_len]).reshape(count, seq_len)
      most = max(most, 1 + int((inputs[:, :-1] == self.eos).sum(axis=1).max()))
    return most


class TokenFile(TokenWindows):
  """Windows of a token file, read from it at each batch: a file that shrinks under the run is an error naming it
  and the step, where a read of a memory map past the file's new end kills the process (SIGBUS)."""

  def __init__(self, path, dtype, vocab_size, seq_len, where, eos=None, dtype_key=None):
    """`dtype_key`: the key that set `dtype` (None: the trainer chose it), named where the ids read wrong."""
    size, itemsize = path.stat().st_size, np.dtype(dtype).itemsize
    if size == 0:
      raise UserError(f"{where} is empty")
    if size % itemsize:
      raise UserError(f"{where} holds {size} bytes, not a whole number of {dtype} tokens ({itemsize} bytes each): "
                      f"is {dtype_key or 'data.token_dtype'} right?")
    tokens = np.memmap(path, dtype=dtype, mode="r")
    if dtype_key:
      _check_width(tokens, where, dtype_key)
    # `tokens` are the ids as they were at the start, each checked once here; batches read the file.
    super().__init__(tokens, vocab_size, seq_len, where, eos)
    self.path, self.dtype = path, np.dtype(dtype)

  def windows(self, starts, length, step):
    nbytes = length * self.dtype.itemsize
    with open(self.path, "rb") as f:
      read = [os.pread(f.fileno(), nbytes, (self.first + int(s)) * self.dtype.itemsize) for s in starts]
    if any(len(r) < nbytes for r in read):
      raise DataChanged(f"{self.batch_name} {step}: {self.where} shrank under the run to {self.path.stat().st_size} bytes "
                        f"({self.num_tokens * self.dtype.itemsize} when it started); stopping")
    return [np.frombuffer(r, self.dtype) for r in read]


WIDTH_SAMPLE = 1 << 16  # uint16 tokens looked at for the high halves of uint32 ids


def _check_width(tokens, where, dtype_key):
  """uint32 ids read as uint16 are each an id and a 0 (their high half): refused, where every second of the first
  uint16s is 0 and the others are not all 0."""
  sample = np.asarray(tokens[:WIDTH_SAMPLE])
  if tokens.dtype == np.uint16 and sample.size >= 64 and not sample[1::2].any() and sample[0::2].any():
    raise UserError(f"{where} reads as uint32 ids: every second of its first {sample.size} uint16 tokens is 0; set "
                    f"{dtype_key}=uint32")


def data_stamp(data_config):
  """The data file's size and modification time (None for synthetic data): run_config.json keeps them, so that a
  resume can say when the data changed since."""
  if data_config.kind == "synthetic":
    return None
  stat = pathlib.Path(data_config.path).stat()
  return dict(path=str(pathlib.Path(data_config.path).resolve()), bytes=stat.st_size, mtime_ns=stat.st_mtime_ns)


def data_change(before, now):
  """A line saying how the data file changed between two `data_stamp`s, or None."""
  if not before or not now or before == now:
    return None
  when = lambda stamp: datetime.datetime.fromtimestamp(stamp["mtime_ns"] / 1e9).isoformat(sep=" ", timespec="seconds")
  return (f"warning: the data changed since the run's checkpoints were written: {before['path']} "
          f"({before['bytes']} bytes, modified {when(before)}), now {now['path']} ({now['bytes']} bytes, modified "
          f"{when(now)}); the resumed run reads the new data")


def documents(tokens_BS1, eos):
  """The batch `tokens_BS1` as the train step takes it: {"tokens"}, and with an `eos` id {"segment_ids",
  "positions"} of every token [B, S+1] (int32): a document ends with its EOS, so a token's segment counts the EOS
  before it in the window, and its position is its place in that segment (0 at each document's start)."""
  if eos is None:
    return {"tokens": tokens_BS1}
  index_BS = np.broadcast_to(np.arange(tokens_BS1.shape[1]), tokens_BS1.shape)
  ends_BS = tokens_BS1 == eos
  segments_BS = np.concatenate([np.zeros_like(ends_BS[:, :1], np.int32),
                                np.cumsum(ends_BS[:, :-1], axis=1, dtype=np.int32)], axis=1)
  starts_BS = np.concatenate([np.ones_like(ends_BS[:, :1]), ends_BS[:, :-1]], axis=1)
  positions_BS = index_BS - np.maximum.accumulate(np.where(starts_BS, index_BS, 0), axis=1)
  return {"tokens": tokens_BS1, "segment_ids": segments_BS, "positions": positions_BS.astype(np.int32)}


def next_token_inputs(batch):
  """(inputs [B, S], labels [B, S], the model's keyword arguments for packed documents with their `weights_BS`: 1
  where a target is in its input's document) of a batch (`documents`; numpy or JAX arrays); without segment ids,
  no keyword arguments."""
  tokens_BS1 = batch["tokens"]
  if "segment_ids" not in batch:
    return tokens_BS1[:, :-1], tokens_BS1[:, 1:], {}
  segments_BS1 = batch["segment_ids"]
  return tokens_BS1[:, :-1], tokens_BS1[:, 1:], dict(
      segment_ids_BS=segments_BS1[:, :-1], positions_BS=batch["positions"][:, :-1],
      weights_BS=segments_BS1[:, 1:] == segments_BS1[:, :-1])


def batch_keys(data_config):
  """The arrays of a batch of this data (`documents`)."""
  return ("tokens", "segment_ids", "positions") if data_config.masks_documents() else ("tokens",)


def batch(source, step, batch_size, seq_len, masks_documents):
  """Batch `step` of `source`, with its documents where `masks_documents` (`DataConfig.masks_documents`)."""
  return documents(source.batch(step, batch_size, seq_len), source.eos if masks_documents else None)


def make_sources(data_config, eval_config, vocab_size, seq_len, held_out=False):
  """(training source, held-out source or None: see `train.config.EvalConfig`); `held_out`: wanted even when
  `eval.every` is 0. Training data whose every target is left out of the loss (only EOS ids) is refused."""
  train, held_out = _sources(data_config, eval_config, vocab_size, seq_len, held_out)
  if data_config.masks_documents() and train.eos is not None and _only(train.tokens, train.eos):
    raise UserError(f"{train.where} holds only the EOS id {train.eos} (data.eos_token): no target is in its input's "
                    "document, so there is nothing to train on (the loss read 0)")
  return train, held_out


def _only(tokens, value, scan=1 << 20):
  """Whether every one of `tokens` is `value` (read a chunk at a time, stopping at the first other)."""
  return all(np.all(np.asarray(tokens[start:start + scan]) == value) for start in range(0, tokens.size, scan))


def _sources(data_config, eval_config, vocab_size, seq_len, held_out):
  if not (held_out or eval_config.every or eval_config.path or eval_config.fraction):
    return make_source(data_config, vocab_size, seq_len), None
  if eval_config.path:
    if data_config.kind == "synthetic":
      raise UserError(f"eval.path={eval_config.path!r} is for data read from a file; the synthetic language's "
                      "held-out batches are fresh samples of it: leave eval.path out (or set data.kind)")
    _check_eval_path(data_config, eval_config)
    return (make_source(data_config, vocab_size, seq_len),
            make_source(dataclasses.replace(data_config, path=eval_config.path,
                                            token_dtype=eval_config.token_dtype or data_config.token_dtype),
                        vocab_size, seq_len, "eval.path"))
  if data_config.kind == "synthetic":
    if eval_config.fraction:
      raise UserError("eval.fraction splits documents off the data; the synthetic language has none (its held-out "
                       "batches are fresh samples: leave eval.fraction out)")
    return (make_source(data_config, vocab_size, seq_len),
            SyntheticLanguage(vocab_size, data_config.branching, data_config.seed, held_out=True))
  if not eval_config.fraction:
    raise UserError("held-out batches (eval.every, --eval-only) need held-out data: eval.path or eval.fraction")
  whole = make_source(data_config, vocab_size)
  if whole.eos is None:
    raise UserError(f"eval.fraction={eval_config.fraction} splits the data by document, and data.kind="
                     f"{data_config.kind!r} without an EOS id has no documents: give eval.path")
  cut = _document_boundary(whole.tokens, int(whole.tokens.size * (1 - eval_config.fraction)), whole.eos)
  return (whole.part(0, cut, seq_len, f"{whole.where} less eval.fraction"),
          whole.part(cut, whole.num_tokens, seq_len, f"eval.fraction={eval_config.fraction} of {whole.where}"))


def _check_eval_path(data_config, eval_config):
  """eval.path is another file than data.path, and eval.token_dtype is for token files."""
  if eval_config.token_dtype and data_config.kind != "tokens":
    raise UserError(f"eval.token_dtype={eval_config.token_dtype!r} is for data.kind=tokens, not {data_config.kind!r}")
  try:
    same = os.path.samefile(eval_config.path, data_config.path)
  except OSError:  # one is missing: make_source names it
    return
  if same:
    raise UserError(f"eval.path={eval_config.path!r} is data.path, which the run trains on: give held-out data, "
                    "or eval.fraction to split some off")


def _document_boundary(tokens, cut, eos, scan=1 << 20):
  """The index after the first EOS at or after `cut`: where a split leaves every document whole."""
  for start in range(cut, tokens.size, scan):
    ends = np.flatnonzero(np.asarray(tokens[start:start + scan]) == eos)
    if ends.size:
      return start + int(ends[0]) + 1
  raise UserError(f"no document ends after token {cut} of {tokens.size}: eval.fraction leaves no whole document")


def make_source(data_config, vocab_size, seq_len=None, key="data.path"):
  """The run's batches; with `seq_len`, data too short for one sequence is refused here, before any compile.
  `key`: the config key that named the file, for errors."""
  kind = data_config.kind
  if kind == "synthetic":
    return SyntheticLanguage(vocab_size, data_config.branching, data_config.seed)
  path = pathlib.Path(data_config.path)
  where = f"{key} {str(path)!r}"
  if not path.exists():
    raise UserError(f"{where} does not exist")
  if not path.is_file():
    raise UserError(f"{where} is {'a directory' if path.is_dir() else 'not a regular file'}; give a file")
  if kind == "tokens":
    eos = data_config.eos_token if isinstance(data_config.eos_token, int) else None
    if eos is not None and eos >= vocab_size:
      raise UserError(f"data.eos_token={eos} is out of range for model.vocab_size={vocab_size}")
    dtype_key = "eval.token_dtype" if key == "eval.path" else "data.token_dtype"
    return TokenFile(path, data_config.token_dtype, vocab_size, seq_len, where, eos, dtype_key)
  if data_config.tokenizer:
    return _tokenized_text(data_config, vocab_size, seq_len)
  if vocab_size < 256:
    raise UserError(f"data.kind=text without data.tokenizer reads bytes and needs model.vocab_size ≥ 256; the model "
                    f"has {vocab_size}")
  if path.suffix in (".jsonl", ".json") and jax.process_index() == 0:
    print(f"warning: {where} is read as bytes, its JSON syntax included, since no data.tokenizer is given (with one, "
          f"each line's {data_config.text_field!r} field is a document)", flush=True)
  data = path.read_bytes()
  _check_utf8(data, where)
  return TokenWindows(np.frombuffer(data, dtype=np.uint8), vocab_size, seq_len, where)


UTF8_CHUNK = 1 << 24  # bytes decoded at a time when checking a text file


def _check_utf8(data, where):
  """data.kind=text without a tokenizer trains on the bytes of UTF-8 text: a binary file is refused, naming the
  first byte that is not UTF-8."""
  decoder = codecs.getincrementaldecoder("utf-8")()
  view = memoryview(data)
  for start in range(0, len(data) or 1, UTF8_CHUNK):
    try:
      decoder.decode(view[start:start + UTF8_CHUNK], final=start + UTF8_CHUNK >= len(data))
    except UnicodeDecodeError as err:
      raise UserError(f"{where} is not UTF-8 text (near byte {start + err.start}); data.kind=text reads text, "
                      "data.kind=tokens token ids") from None


def _tokenized_text(data_config, vocab_size, seq_len):
  """Windows over the text's cached tokens: process 0 tokenises (when the cache is missing), the others wait for it."""
  text = TokenizedText(data_config)
  if jax.process_index() == 0:
    text.build()
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices("relaymoe: tokenized text cached")
    if not text.cache.exists():
      raise UserError(f"process {jax.process_index()} does not see the tokenised cache {text.cache} that process 0 "
                      "wrote: put data.cache_dir on a filesystem all processes share")
  try:
    return TokenFile(text.cache, text.dtype, vocab_size, seq_len, f"the tokenised data.path {data_config.path!r}",
                     text.eos)
  except ValueError as err:
    if "out of range" not in str(err):
      raise
    raise UserError(f"{err} (the tokenizer {data_config.tokenizer} has {text.vocab_size} ids: set "
                    f"model.vocab_size ≥ {text.vocab_size})") from None
