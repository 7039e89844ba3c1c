"""Run configs: frozen dataclasses per concern, loaded from YAML under configs/runs/, unknown keys rejected by name."""

import dataclasses

from models.config import from_mapping, override, parse_assignment, read_yaml
from models.runtime import RUNTIME_FIELDS, RuntimeConfig
from relaymoe_jax.errors import UserError


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
  """Device counts per mesh axis; one axis may be -1 (all the devices left)."""

  data: int = 1  # devices over which batch rows are split
  expert: int = -1  # devices over which experts are split: the MoE ring (and the sequence, with context_parallel)
  tensor: int = 1  # devices over which expert F is split with runtime.moe_tensor_parallel


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
  """kind: synthetic (built-in language with a known entropy floor), tokens (pre-tokenised .bin), text (bytes, or
  tokens of `tokenizer`: `train.data.text`)."""

  kind: str = "synthetic"  # synthetic, tokens (a pre-tokenised .bin) or text (a UTF-8 file, .jsonl or plain)
  path: str = ""  # the data file (tokens, text)
  token_dtype: str = "uint16"  # tokens: uint16 or uint32
  branching: int = 4  # synthetic: successors per token; the loss floor is ln(branching)
  seed: int = 0  # synthetic: the language drawn
  tokenizer: str = ""  # text: a Hugging Face tokenizer.json; "" = bytes
  text_field: str = "text"  # text with a tokenizer, .jsonl input: the field holding each document
  separator: str = ""  # text with a tokenizer, plain-text input: a line equal to this ends a document; "" = blank
  # text with a tokenizer: written after every document, a token name or id ("" = found in the tokenizer);
  # tokens: the id that ends each document in the file ("" = none known)
  eos_token: str | int = ""
  cache_dir: str = ""  # where tokenised text is cached as .bin; "" = beside the input
  # Packed documents do not attend to each other, RoPE positions restart at each, and no loss is taken on a
  # document's EOS predicting the next one's first token (segments from the EOS ids: `train.data.batches.documents`).
  # auto: on for text with a tokenizer and for tokens with an eos_token; off for the synthetic language and bytes.
  document_masking: bool | str = "auto"

  def __post_init__(self):
    if self.kind not in ("synthetic", "tokens", "text"):
      raise UserError(f"data.kind={self.kind!r} must be one of synthetic, tokens, text")
    if self.kind != "synthetic" and not self.path:
      raise UserError(f"data.kind={self.kind!r} needs data.path")
    if self.token_dtype not in ("uint16", "uint32"):
      raise UserError(f"data.token_dtype={self.token_dtype!r} must be uint16 or uint32")
    if self.tokenizer and self.kind != "text":
      raise UserError(f"data.tokenizer is for data.kind=text, not {self.kind!r}")
    if not self.text_field:
      raise UserError("data.text_field must not be empty")
    if isinstance(self.eos_token, int) and self.eos_token < 0:
      raise UserError(f"data.eos_token={self.eos_token} must be a token name or an id ≥ 0")
    if self.kind == "tokens" and self.eos_token != "" and not isinstance(self.eos_token, int):
      raise UserError(f"data.eos_token={self.eos_token!r}: a token file's end of document is an id, not a name")
    if self.document_masking not in (True, False, "auto"):
      raise UserError(f"data.document_masking={self.document_masking!r} must be true, false or auto")
    if self.document_masking is True and not self.has_documents():
      raise UserError(f"data.document_masking=true needs documents: data.kind=text with a data.tokenizer, or "
                       f"data.kind=tokens with data.eos_token (the id that ends each); this is data.kind="
                       f"{self.kind!r}" + (" without a tokenizer (bytes)" if self.kind == "text" else ""))

  def has_documents(self):
    """Whether the data marks where documents end (an EOS id)."""
    return (self.kind == "text" and bool(self.tokenizer)) or (self.kind == "tokens" and self.eos_token != "")

  def masks_documents(self):
    return self.has_documents() and self.document_masking is not False


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalConfig:
  """The held-out loss: `batches` batches of the run's shape, the same each time, every `every` steps and after the
  last (0: only after the last, and only where `path` or `fraction` gives held-out data). From `path` (a file of
  data.path's kind), else the last `fraction` of the training data split off at a document boundary (the training
  run never sees it), else, for the synthetic language, fresh samples."""

  path: str = ""  # a held-out file of data.kind's kind
  token_dtype: str = ""  # `path`'s, for data.kind=tokens: uint16 or uint32; "" = data.token_dtype
  fraction: float = 0.0  # else: this last fraction of the training data, split off at a document end
  # steps between held-out losses, and after the last step; 0: only after the last, where path or fraction is given
  every: int = 0
  batches: int = 4  # held-out batches of the run's shape, the same ones each time

  def __post_init__(self):
    if self.token_dtype not in ("", "uint16", "uint32"):
      raise UserError(f"eval.token_dtype={self.token_dtype!r} must be uint16 or uint32 (or empty: data.token_dtype)")
    if self.token_dtype and not self.path:
      raise UserError(f"eval.token_dtype={self.token_dtype!r} is eval.path's token width, and no eval.path is given")
    if not 0 <= self.fraction < 1:
      raise UserError(f"eval.fraction={self.fraction} must be in [0, 1)")
    if self.path and self.fraction:
      raise UserError(f"eval.path={self.path!r} and eval.fraction={self.fraction}: give one")
    if self.every < 0 or self.batches < 1:
      raise UserError(f"eval.every={self.every} must be ≥ 0 and eval.batches={self.batches} ≥ 1")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimConfig:
  """AdamW with linear warmup and cosine decay to min_lr_ratio · learning_rate; gradient clipping by global norm."""

  learning_rate: float = 3e-3  # the peak, reached after warmup_steps
  warmup_steps: int = 20  # linear from 0
  min_lr_ratio: float = 0.1  # the cosine decay ends at this fraction of learning_rate at the last step
  weight_decay: float = 0.1  # AdamW's, decoupled
  b1: float = 0.9  # Adam's first-moment decay
  b2: float = 0.95  # Adam's second-moment decay
  eps: float = 1e-8  # Adam's epsilon
  grad_clip: float = 1.0  # the global gradient norm is clipped to this

  def __post_init__(self):
    checks = dict(learning_rate=(self.learning_rate >= 0, "≥ 0"), warmup_steps=(self.warmup_steps >= 0, "≥ 0"),
                  min_lr_ratio=(0 <= self.min_lr_ratio <= 1, "in [0, 1]"),
                  weight_decay=(self.weight_decay >= 0, "≥ 0"), b1=(0 <= self.b1 < 1, "in [0, 1)"),
                  b2=(0 <= self.b2 < 1, "in [0, 1)"), eps=(self.eps >= 0, "≥ 0"),
                  grad_clip=(self.grad_clip > 0, "> 0"))
    for name, (ok, wanted) in checks.items():
      if not ok:  # NaN fails every comparison
        raise UserError(f"optim.{name}={getattr(self, name)} must be {wanted}")


INIT_SOURCES = ("hf:", "orbax:")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
  model: str = "tiny"  # a name under configs/models/ or a YAML path
  # Architecture keys on top of the model's (`model.KEY=VALUE` on the command line; --print-config lists them).
  model_overrides: dict = dataclasses.field(default_factory=dict)
  # Start from released or converted weights instead of a random init: "hf:DIR" (a Hugging Face directory) or
  # "orbax:DIR" (`relaymoe-convert hf-to-orbax`'s output, or a training run's directory: its newest checkpoint). The
  # model config then comes from DIR (`model` is not read), with model_overrides on top. "": random init.
  init_from: str = ""
  # How the model runs: dispatcher and its options, remat (per layer, or "auto": the cheapest plan that fits the
  # device, chosen at start by `train.plan.planner` and stored in run_config.json), compute dtype, sharding choices.
  runtime: RuntimeConfig = RuntimeConfig()
  device_memory_gib: float = 0.0  # per device, for the fit check and `remat: auto`; 0 = the allocator's limit
  # Of that limit, kept free for what XLA's buffer assignment leaves out. On an H200 the compiled step's bytes equal
  # the measured peak (four steps, to 0.01 GiB) and steps at 99.4% of the limit trained: see docs/memory.md.
  memory_headroom: float = 0.005
  mesh: MeshConfig = MeshConfig()
  data: DataConfig = DataConfig()
  eval: EvalConfig = EvalConfig()
  optim: OptimConfig = OptimConfig()
  batch_size: int = 16  # global sequences per step
  # Gradient accumulation: the step runs batch_size / micro_batches sequences at a time, in one compiled loop, and
  # updates once with the whole batch's loss and gradients (`train.accumulate`).
  micro_batches: int = 1
  seq_len: int = 64  # tokens per sequence
  steps: int = 300  # optimizer steps in all (a resumed run continues up to it)
  seed: int = 0  # of the random initialisation
  log_every: int = 10  # steps between lines of metrics.jsonl and TensorBoard
  checkpoint_every: int = 100  # and after the last step; 0: never (measurement runs)
  keep_checkpoints: int = 2  # the newest checkpoints kept; older ones are deleted
  # The run directory (--out), relative to the current directory: run_config.json, metrics.jsonl, checkpoints/,
  # tensorboard/; the shipped run configs set runs/<config name>.
  out_dir: str = "runs/default"
  tensorboard: bool = True  # also write the metrics as TensorBoard events under OUT/tensorboard/
  peak_tflops_per_device: float = 0.0  # for MFU; 0 = from the device kind where known
  # JAX's persistent compilation cache (set by `relaymoe-train`): a rerun or resume of the same step loads it
  # instead of compiling again. "" = off.
  compilation_cache_dir: str = "~/.cache/relaymoe-jax/xla"

  def __post_init__(self):
    if self.checkpoint_every < 0:
      raise UserError(f"checkpoint_every={self.checkpoint_every} must be ≥ 0 (0: never)")
    for name in ("batch_size", "micro_batches", "seq_len", "log_every", "keep_checkpoints"):
      if getattr(self, name) < 1:
        raise UserError(f"{name}={getattr(self, name)} must be ≥ 1")
    if self.batch_size % self.micro_batches:
      raise UserError(f"batch_size={self.batch_size} does not split into micro_batches={self.micro_batches}")
    if self.steps < 0:
      raise UserError(f"steps={self.steps} must be ≥ 0")
    if self.init_from and not self.init_from.startswith(INIT_SOURCES):
      raise UserError(f"init_from={self.init_from!r} must start with one of {list(INIT_SOURCES)} (or be empty)")
    if not 0 <= self.memory_headroom < 1:
      raise UserError(f"memory_headroom={self.memory_headroom} must be in [0, 1)")


  @property
  def micro_batch_size(self):
    """Sequences per micro-batch: what one pass of the model holds."""
    return self.batch_size // self.micro_batches


# Keys that were the run's or the model config's before `runtime` held them, and where they are now.
MOVED = {"dispatcher": "runtime.dispatcher", "remat": "runtime.remat",
         **{f"model.{key}": f"runtime.{key}" for key in RUNTIME_FIELDS}}


def load_run_config(path_or_name="default", overrides=()):
  """A run config from YAML (a path, or a name under configs/runs/), then `key=value` overrides.

  `model.KEY=VALUE` sets a model-config key (checked when the model config is built); `runtime.KEY=VALUE` how the
  model runs.
  """
  data = read_yaml(path_or_name, "runs")
  _refuse_moved([*data, *(f"model.{k}" for k in data.get("model_overrides") or {}),
                 *(a.split("=", 1)[0] for a in overrides)], path_or_name)
  config = from_mapping(RunConfig, data, f"run config {path_or_name}")
  config = override(config, [a for a in overrides if not a.startswith("model.")])
  model_keys = dict(parse_assignment(a[len("model."):]) for a in overrides if a.startswith("model."))
  return dataclasses.replace(config, model_overrides={**config.model_overrides, **model_keys})


def _refuse_moved(keys, where):
  moved = {k: MOVED[k] for k in keys if k in MOVED}
  if moved:
    raise UserError(f"run config {where}: " + ", ".join(f"{old} is now {new}" for old, new in moved.items()))
