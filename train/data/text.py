"""Text tokenised with a Hugging Face `tokenizers` tokenizer.json, cached in the `.bin` token format.

Input: a `.jsonl` file holds one document per line, its text in the field `data.text_field` (blank lines skipped);
any other file is UTF-8 plain text whose documents end at a line equal to `data.separator` (stripped; the default
"" is a blank line), each document its lines joined with their newlines kept, leading and trailing newlines
dropped. Empty documents are skipped. Each document is encoded without the tokenizer's own special tokens
(`add_special_tokens=False`) and followed by the EOS id; documents are read as a stream and encoded a batch at a
time (`encode_batch`).

The cache, `NAME.KEY.uint16.bin` (uint32 for a vocabulary over 65536), lies beside the input or in
`data.cache_dir`. KEY hashes the input's path, size and modification time, the tokenizer file's content, the EOS id
and the document settings, so a second run reads the cache and a changed input or tokenizer tokenises again. It is
written to a temporary file and renamed, so a killed run never leaves a partial cache.
"""

import hashlib
import itertools
import json
import os
import pathlib
import time

import numpy as np
from tokenizers import Tokenizer

from relaymoe_jax.errors import UserError

EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>")
BATCH_CHARS = 1 << 20  # characters per `encode_batch` call, so a large file is never one call
CACHE_VERSION = 1  # in the key: bump when the cache's content for the same settings changes


class TokenizedText:
  """The tokenizer and settings of a `data.kind=text` config with a tokenizer, and where its cache lies."""

  def __init__(self, data_config):
    self.config = data_config
    self.input = pathlib.Path(data_config.path).resolve()
    tokenizer_path = pathlib.Path(data_config.tokenizer).expanduser()
    if not tokenizer_path.is_file():
      raise UserError(f"data.tokenizer {data_config.tokenizer!r} is not a file")
    tokenizer_bytes = tokenizer_path.read_bytes()
    try:
      self.tokenizer = Tokenizer.from_str(tokenizer_bytes.decode("utf-8"))
    except Exception as err:  # tokenizers raises its own Exception subclass for every malformed file
      raise UserError(f"data.tokenizer {data_config.tokenizer!r} does not load: {err}") from None
    self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
    self.eos = eos_id(self.tokenizer, data_config.eos_token, data_config.tokenizer)
    self.dtype = "uint16" if self.vocab_size <= 1 << 16 else "uint32"
    self.jsonl = self.input.suffix == ".jsonl"
    self.cache = self._cache_path(hashlib.sha256(tokenizer_bytes).hexdigest())

  def _cache_path(self, tokenizer_hash):
    stat = self.input.stat()
    documents = dict(text_field=self.config.text_field) if self.jsonl else dict(separator=self.config.separator)
    settings = dict(version=CACHE_VERSION, input=str(self.input), size=stat.st_size, mtime_ns=stat.st_mtime_ns,
                    tokenizer=tokenizer_hash, eos=self.eos, **documents)
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    directory = pathlib.Path(self.config.cache_dir).expanduser() if self.config.cache_dir else self.input.parent
    return directory / f"{self.input.name}.{key}.{self.dtype}.bin"

  def documents(self):
    if self.jsonl:
      return jsonl_documents(self.input, self.config.text_field)
    return text_documents(self.input, self.config.separator)

  def write_cache(self):
    """Tokenises the input into the cache (temporary file, then rename); returns (tokens, documents)."""
    self.cache.parent.mkdir(parents=True, exist_ok=True)
    partial = self.cache.with_name(f"{self.cache.name}.partial-{os.getpid()}")
    tokens = documents = 0
    try:
      with open(partial, "wb") as f:
        for batch in batches(self.documents()):
          ids = encode(self.tokenizer, batch, self.eos)
          np.asarray(ids, self.dtype).tofile(f)
          tokens, documents = tokens + len(ids), documents + len(batch)
        f.flush()
        os.fsync(f.fileno())
      if not tokens:
        raise UserError(f"data.path {str(self.input)!r} holds no documents")
      os.replace(partial, self.cache)
    finally:
      partial.unlink(missing_ok=True)
    return tokens, documents

  def build(self):
    """Writes the cache unless it exists, saying so on stdout."""
    if self.cache.exists():
      return
    print(f"tokenizing {self.input} with {self.config.tokenizer} into {self.cache}", flush=True)
    start = time.perf_counter()
    try:
      tokens, documents = self.write_cache()
    except OSError as err:  # a read-only directory, a full disk
      where = "data.cache_dir" if self.config.cache_dir else "the input's directory (set data.cache_dir for another)"
      raise UserError(f"cannot write the tokenised cache {self.cache} in {where}: "
                      f"{err.strerror or err}") from None
    print(f"{tokens} tokens in {documents} documents ({time.perf_counter() - start:.1f} s)", flush=True)


def eos_id(tokenizer, eos_token, tokenizer_name):
  """The id of `eos_token` (a name or an id), or, when it is "", of the first of EOS_NAMES the tokenizer has."""
  if isinstance(eos_token, int):
    if tokenizer.id_to_token(eos_token) is None:
      raise UserError(f"data.eos_token={eos_token} is not an id of the tokenizer {tokenizer_name}")
    return eos_token
  names = (eos_token,) if eos_token else EOS_NAMES
  for name in names:
    found = tokenizer.token_to_id(name)
    if found is not None:
      return found
  if eos_token:
    raise UserError(f"data.eos_token={eos_token!r} is not a token of the tokenizer {tokenizer_name}")
  raise UserError(f"the tokenizer {tokenizer_name} has none of the usual end-of-document tokens {list(EOS_NAMES)}: "
                  "set data.eos_token to the name or id of the token to write after each document")


def utf8_lines(path):
  """(line number, line) of a UTF-8 file; a byte that is not UTF-8 is named by its line and its byte in the file."""
  offset = 0
  with open(path, "rb") as f:
    for number, raw in enumerate(f, 1):
      try:
        yield number, raw.decode("utf-8").replace("\r\n", "\n")
      except UnicodeDecodeError as err:
        raise UserError(f"data.path {str(path)!r}, line {number}, byte {offset + err.start}: not UTF-8 "
                        f"({err.reason})") from None
      offset += len(raw)


def jsonl_documents(path, field):
  for number, line in utf8_lines(path):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
    except json.JSONDecodeError as err:
      raise UserError(f"{path}, line {number}: not JSON ({err})") from None
    text = record.get(field) if isinstance(record, dict) else None
    if not isinstance(text, str):
      raise UserError(f"{path}, line {number}: no string field {field!r} (data.text_field)")
    yield text


def text_documents(path, separator):
  lines = []
  for _, line in utf8_lines(path):
    if line.strip() == separator:
      yield "".join(lines).strip("\n")
      lines = []
    else:
      lines.append(line)
  yield "".join(lines).strip("\n")


def batches(documents):
  """Lists of non-empty documents of about BATCH_CHARS characters in all."""
  batch, chars = [], 0
  for text in documents:
    if not text:
      continue
    batch.append(text)
    chars += len(text)
    if chars >= BATCH_CHARS:
      yield batch
      batch, chars = [], 0
  if batch:
    yield batch


def encode(tokenizer, texts, eos):
  """The token ids of `texts`, each followed by `eos`, as one list."""
  encodings = tokenizer.encode_batch(texts, add_special_tokens=False)
  return list(itertools.chain.from_iterable((*e.ids, eos) for e in encodings))
