"""Text tokenised with a tokenizer.json (`train.data.text`): the token stream of .txt and .jsonl input, the cache (reused,
renewed when the input or tokenizer changes, never left partial), the errors a user can act on, and a short run."""

import json
import math
import os

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

import train.data.text
from conftest import requires_devices
from train.config import DataConfig, MeshConfig, RunConfig, load_run_config
from train.data.batches import make_source
from train.loop import run

SENTENCES = ["the relay passes tokens around the ring", "experts compute their rows and send them back",
             "hello world, the ring turns", "a router picks two experts for every token"]
DOCUMENTS = ["the relay passes tokens\naround the ring", "hello world, the ring turns", "experts compute"]


def make_tokenizer(path, special_tokens=("<unk>", "<|endoftext|>"), vocab_size=90):
  tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
  tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
  tokenizer.train_from_iterator(SENTENCES, trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=list(special_tokens), show_progress=False))
  tokenizer.save(str(path))
  return tokenizer


@pytest.fixture
def tokenizer(tmp_path):
  return make_tokenizer(tmp_path / "tokenizer.json")


def text_config(tmp_path, path, **changes):
  return DataConfig(kind="text", path=str(path), tokenizer=str(tmp_path / "tokenizer.json"), **changes)


def expected_stream(tokenizer, documents, eos):
  return [i for d in documents for i in (*tokenizer.encode(d, add_special_tokens=False).ids, eos)]


def write_jsonl(path, records):
  path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")


def test_plain_text_is_documents_between_blank_lines_each_followed_by_eos(tmp_path, tokenizer):
  corpus = tmp_path / "corpus.txt"
  corpus.write_text("\n" + DOCUMENTS[0] + "\n\n\n" + DOCUMENTS[1] + "\n  \n" + DOCUMENTS[2] + "\n", encoding="utf-8")
  source = make_source(text_config(tmp_path, corpus), 128)
  eos = tokenizer.token_to_id("<|endoftext|>")
  assert source.tokens.dtype == np.uint16
  assert source.tokens.tolist() == expected_stream(tokenizer, DOCUMENTS, eos)
  np.testing.assert_array_equal(source.batch(1, 1, 4)[0], source.tokens[4:9])

  corpus.write_text(f"{DOCUMENTS[0]}\n\n{DOCUMENTS[1]}\n<|endoftext|>\n{DOCUMENTS[2]}\n", encoding="utf-8")
  source = make_source(text_config(tmp_path, corpus, separator="<|endoftext|>"), 128)
  assert source.tokens.tolist() == expected_stream(tokenizer, [f"{DOCUMENTS[0]}\n\n{DOCUMENTS[1]}", DOCUMENTS[2]], eos)


def test_jsonl_is_one_document_per_line_in_its_text_field(tmp_path, tokenizer):
  corpus = tmp_path / "corpus.jsonl"
  write_jsonl(corpus, [{"id": i, "body": d} for i, d in enumerate(DOCUMENTS)])
  source = make_source(text_config(tmp_path, corpus, text_field="body", eos_token="<unk>"), 128)
  assert source.tokens.tolist() == expected_stream(tokenizer, DOCUMENTS, tokenizer.token_to_id("<unk>"))
  by_id = make_source(text_config(tmp_path, corpus, text_field="body", eos_token=0), 128)
  assert by_id.tokens.tolist() == source.tokens.tolist()


def test_the_cache_is_reused_and_renewed_when_the_input_or_tokenizer_changes(tmp_path, tokenizer, monkeypatch):
  corpus = tmp_path / "corpus.jsonl"
  write_jsonl(corpus, [{"text": d} for d in DOCUMENTS])
  config = text_config(tmp_path, corpus, cache_dir=str(tmp_path / "cache"))
  first = make_source(config, 128).tokens.tolist()
  [cache] = (tmp_path / "cache").iterdir()
  assert cache.name.startswith("corpus.jsonl.") and cache.name.endswith(".uint16.bin")
  written = cache.stat().st_mtime_ns

  def no_encoding(*args):
    raise AssertionError("tokenised again")
  with monkeypatch.context() as m:
    m.setattr(train.data.text, "encode", no_encoding)
    assert make_source(config, 128).tokens.tolist() == first
  assert cache.stat().st_mtime_ns == written

  write_jsonl(corpus, [{"text": d} for d in DOCUMENTS[:2]])
  changed_input = make_source(config, 128).tokens.tolist()
  assert changed_input == expected_stream(tokenizer, DOCUMENTS[:2], tokenizer.token_to_id("<|endoftext|>"))
  other = make_tokenizer(tmp_path / "tokenizer.json", special_tokens=("<|endoftext|>", "<unk>"))
  changed_tokenizer = make_source(config, 128).tokens.tolist()
  assert changed_tokenizer == expected_stream(other, DOCUMENTS[:2], other.token_to_id("<|endoftext|>"))
  assert changed_tokenizer != changed_input
  assert len(list((tmp_path / "cache").iterdir())) == 3  # earlier caches are left, never overwritten


def test_a_failure_while_tokenising_leaves_no_cache_and_names_the_line(tmp_path, tokenizer, monkeypatch):
  monkeypatch.setattr(train.data.text, "BATCH_CHARS", 1)  # a batch per document: the first are written before line 4
  corpus = tmp_path / "corpus.jsonl"
  write_jsonl(corpus, [{"text": d} for d in DOCUMENTS] + [{"txt": "a typo"}])
  with pytest.raises(ValueError, match=r"corpus.jsonl, line 4: no string field 'text' \(data.text_field\)"):
    make_source(text_config(tmp_path, corpus), 128)
  write_jsonl(corpus, [{"text": d} for d in DOCUMENTS])
  corpus.write_text(corpus.read_text() + "\n{not json\n")
  with pytest.raises(ValueError, match=r"corpus.jsonl, line 5: not JSON"):  # the blank line 4 counts, skipped
    make_source(text_config(tmp_path, corpus), 128)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.jsonl", "tokenizer.json"]


def test_errors_name_what_to_set(tmp_path):
  make_tokenizer(tmp_path / "tokenizer.json", special_tokens=("<unk>", "[SEP]"))
  corpus = tmp_path / "corpus.txt"
  corpus.write_text("\n\n".join(DOCUMENTS), encoding="utf-8")
  with pytest.raises(ValueError, match=r"none of the usual end-of-document tokens .*set data.eos_token"):
    make_source(text_config(tmp_path, corpus), 128)
  with pytest.raises(ValueError, match=r"data.eos_token='</s>' is not a token of the tokenizer"):
    make_source(text_config(tmp_path, corpus, eos_token="</s>"), 128)
  with pytest.raises(ValueError, match=r"data.eos_token=5000 is not an id of the tokenizer"):
    make_source(text_config(tmp_path, corpus, eos_token=5000), 128)
  assert make_source(text_config(tmp_path, corpus, eos_token="[SEP]"), 128).tokens[-1] == 1
  with pytest.raises(ValueError, match=r"token id \d+ is out of range for model.vocab_size=16 \(the tokenizer .* "
                                       r"has \d+ "
                                       r"ids: set model.vocab_size ≥ \d+\)"):
    make_source(text_config(tmp_path, corpus, eos_token="[SEP]"), 16)
  with pytest.raises(ValueError, match="data.tokenizer 'nonesuch.json' is not a file"):
    make_source(DataConfig(kind="text", path=str(corpus), tokenizer="nonesuch.json"), 128)
  (tmp_path / "empty.txt").write_text("\n\n", encoding="utf-8")
  with pytest.raises(ValueError, match="holds no documents"):
    make_source(text_config(tmp_path, tmp_path / "empty.txt", eos_token="[SEP]"), 128)
  with pytest.raises(ValueError, match="data.tokenizer is for data.kind=text"):
    load_run_config("cpu", ["data.kind=tokens", "data.path=t.bin", "data.tokenizer=tokenizer.json"])
  with pytest.raises(ValueError, match=r"data.eos_token=\[1\] is not a string \(quote it\), or an int"):
    load_run_config("cpu", ["data.eos_token=[1]"])
  (tmp_path / "latin1.txt").write_bytes("first line\nsecond, café\n".encode("latin-1"))
  with pytest.raises(ValueError, match=rf"^data.path '{tmp_path / 'latin1.txt'}', line 2, byte 22: not UTF-8 "):
    make_source(text_config(tmp_path, tmp_path / "latin1.txt", eos_token="[SEP]"), 128)
  (tmp_path / "a file").write_text("")  # a cache that cannot be written (read-only, full) is one line
  with pytest.raises(ValueError, match=rf"^cannot write the tokenised cache {tmp_path / 'a file' / 'cache'}/corpus"
                                       r"\.txt\.\w+\.uint16\.bin in data.cache_dir: "):
    make_source(text_config(tmp_path, corpus, eos_token="[SEP]", cache_dir=str(tmp_path / "a file" / "cache")), 128)


def test_without_a_tokenizer_text_is_still_bytes(tmp_path, capsys):
  (tmp_path / "t.txt").write_text("héllo", encoding="utf-8")
  assert make_source(DataConfig(kind="text", path=str(tmp_path / "t.txt")), 256).tokens.tolist() == \
      list("héllo".encode("utf-8"))
  assert capsys.readouterr().out == ""
  with pytest.raises(ValueError, match=r"^data.kind=text without data.tokenizer reads bytes and needs "
                                       r"model.vocab_size ≥ 256; the model has 128$"):
    make_source(DataConfig(kind="text", path=str(tmp_path / "t.txt")), 128)
  (tmp_path / "t.jsonl").write_text('{"text": "héllo"}\n', encoding="utf-8")  # trained on, but not silently
  assert make_source(DataConfig(kind="text", path=str(tmp_path / "t.jsonl")), 256).tokens.size == 19
  assert capsys.readouterr().out == (f"warning: data.path '{tmp_path / 't.jsonl'}' is read as bytes, its JSON "
                                     "syntax included, since no data.tokenizer is given (with one, each line's "
                                     "'text' field is a document)\n")


@pytest.mark.slow  # an end-to-end run; CI's second step runs it
def test_a_short_run_trains_on_tokenised_text(tmp_path, tokenizer):
  requires_devices(8)
  corpus = tmp_path / "corpus.jsonl"
  write_jsonl(corpus, [{"text": s} for s in SENTENCES * 4])
  config = RunConfig(model="tiny", model_overrides={"vocab_size": 96}, mesh=MeshConfig(data=2, expert=4),
                     batch_size=8, seq_len=16, steps=4, log_every=1, checkpoint_every=0,
                     out_dir=str(tmp_path / "run"), tensorboard=False,
                     data=text_config(tmp_path, corpus))
  history = run(config)
  assert [r["step"] for r in history] == [0, 1, 2, 3]
  assert all(math.isfinite(r["loss"]) for r in history)
  assert history[0]["loss"] == pytest.approx(math.log(96), abs=0.3)
  saved = json.loads((tmp_path / "run" / "run_config.json").read_text())["run"]["data"]
  assert saved["tokenizer"] == str(tmp_path / "tokenizer.json") and os.path.exists(saved["path"])


# Qwen3.5's pre-tokenizer pattern (transformers' `tokenization_qwen3_5.py`): combining marks stay with their letters.
QWEN35_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}|"""
                  r""" ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")


def qwen35_tokenizer(merges=(("t", "h"), ("th", "e"), ("Ġ", "r"), ("Ġr", "i"))):
  """A tokenizer.json laid out as Qwen3.5's (NFC, its split pattern, byte-level BPE, `<|endoftext|>` as id 0) on a
  small vocabulary: the checkpoint's own file is not reachable here, and differs from this one in its merges."""
  from tokenizers import Regex, decoders, normalizers
  vocab = {"<|endoftext|>": 0, **{c: i + 1 for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}}
  vocab.update({a + b: len(vocab) + i for i, (a, b) in enumerate(merges)})
  tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=list(merges)))
  tokenizer.normalizer = normalizers.NFC()
  tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(Regex(QWEN35_PATTERN), behavior="isolated"),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tokenizer.decoder = decoders.ByteLevel()
  tokenizer.add_special_tokens(["<|endoftext|>"])
  return tokenizer, vocab, merges


def test_a_qwen35_tokenizer_file_reads_as_it_encodes(tmp_path):
  """`data.kind=text` with a tokenizer.json in Qwen3.5's layout: each document as the tokenizer encodes it (a
  combining accent, a no-break space, digits one by one), `<|endoftext|>` after each."""
  tokenizer, vocab, _ = qwen35_tokenizer()
  tokenizer.save(str(tmp_path / "tokenizer.json"))
  documents = ["the ring turns", "Cafe\u0301 au lait", "the relay\u00a0passes 12 tokens"]
  corpus = tmp_path / "corpus.jsonl"
  write_jsonl(corpus, [{"text": d} for d in documents])
  source = make_source(text_config(tmp_path, corpus), vocab_size=len(vocab))
  assert source.eos == 0
  assert source.tokens.tolist() == [i for d in documents for i in (*tokenizer.encode(d).ids, 0)]


def test_the_qwen35_layout_is_transformers_own(tmp_path):
  """Where transformers is installed: its `Qwen3_5Tokenizer` on the same vocabulary writes the same pipeline and
  encodes as ours (so the test above reads Qwen3.5's format, not a guess at it)."""
  transformers = pytest.importorskip("transformers")
  tokenizer, vocab, merges = qwen35_tokenizer()
  theirs = transformers.Qwen3_5Tokenizer(vocab=vocab, merges=list(merges))
  theirs.save_pretrained(tmp_path)
  saved = json.loads((tmp_path / "tokenizer.json").read_text())
  ours = json.loads(tokenizer.to_str())
  for part in ("normalizer", "pre_tokenizer", "decoder"):
    assert saved[part] == ours[part], part
  text = "the ring turns: Cafe\u0301 au lait, 12 tokens"
  assert theirs.encode(text, add_special_tokens=False) == tokenizer.encode(text).ids
