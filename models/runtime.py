"""`RuntimeConfig`: how a model runs (dispatcher, recompute, loss chunking, attention kernel, sharding choices,
layer scan, compute dtype), whatever its family; a run config holds it and the planner edits it. Nothing here
changes what the model computes (up to the compute dtype's rounding)."""

import dataclasses
from typing import NamedTuple

import relaymoe_jax as rm
from models.attention.cudnn_documents import DOCUMENTS_PER_ROW
from models.attention.gated_delta import SPAN_TOKENS
from relaymoe_jax.errors import UserError

# What a layer's backward recomputes, from the most memory to the least:
#   none       every activation the layer's backward needs is kept from the forward;
#   attention  attention is recomputed (its inputs are kept); the MoE keeps its residuals (x, pair plan);
#   all_but_attention  as `layer`, but the attention kernel's output and softmax statistics are kept too, so
#              backward reruns the layer's forward but not its attention kernel (`models/remat.py`);
#   layer      only the layer's input is kept; backward reruns the whole layer's forward (the ring included);
#   offload    as `layer`, with that input kept in host memory (`pinned_host`) instead of on the device.
REMAT_POLICIES = ("none", "attention", "all_but_attention", "layer", "offload")
REMAT_AUTO = "auto"  # a run's request for the planner (`train.plan.planner`), resolved before the model is built
LOSS_CHUNK_AUTO = "auto"  # the trainer's choice (`train.plan.loss_chunk`); elsewhere the default below
DOCUMENTS_AUTO = "auto"  # the trainer's choice from the data (`train.run.resolve_documents`); elsewhere DOCUMENTS_PER_ROW
DEFAULT_LOSS_CHUNK_TOKENS = 1024
FLOAT_DTYPES = ("float32", "bfloat16", "float16")  # of the parameters and of the compute

@dataclasses.dataclass(frozen=True, kw_only=True)
class RuntimeConfig:
  """How the model runs: nothing here changes what it computes (up to the compute dtype's rounding)."""

  # MoE block: dispatcher name and its own options (chunk_rows, capacity_factor, backend, ...).
  dispatcher: str = "ring_expert"
  dispatcher_options: tuple = ()  # given as a mapping in YAML; stored as sorted (key, value) pairs (hashable)
  # What backward recomputes, for every layer or one entry per layer (`REMAT_POLICIES`); "auto": the planner
  # (`train.plan.planner`) chooses from the compiled step's memory before the model is built.
  remat: str | tuple[str, ...] = "none"
  # Tokens per device per chunk of the loss head (`models.loss`): the float32 logits are never whole. 0: the
  # plain loss over full logits. "auto": the trainer takes the largest chunk whose compiled step needs no more
  # memory than at DEFAULT_LOSS_CHUNK_TOKENS (`train.plan.loss_chunk`); a model built with "auto" uses the default.
  loss_chunk_tokens: int | str = LOSS_CHUNK_AUTO
  # "auto": cuDNN flash attention on GPUs for bf16/f16 (625 TFLOP/s on H200 against 39 for XLA's), else XLA.
  attention_implementation: str = "auto"
  # M, the most packed documents a row holds in cuDNN's packed layout (Hopper GPUs, without context parallelism):
  # its backward takes temporaries for M slots a row; a call with a fuller row takes the tile loop
  # (`cudnn_documents`). "auto": the trainer takes the most documents a row of the data holds, within one row's
  # temporaries budget (`packed_bound`); a model built with "auto" uses DOCUMENTS_PER_ROW.
  documents_per_row: int | str = DOCUMENTS_AUTO
  # Split the parameters outside the experts (attention, embeddings, dense and shared MLPs) over ('data',
  # 'expert'), every device they would otherwise be replicated on (ZeRO-3); experts are split over 'expert' anyway.
  fsdp: bool = False
  moe_tensor_parallel: bool = False  # split F of every expert over 'tensor' (expert tensor parallelism)
  # Split each sequence over 'expert' (batch rows over 'data' only) in load-balanced causal order; attention
  # gathers K and V across the shards (`models.attention.context_parallel`). seq_len must divide by 2 × expert.
  context_parallel: bool = False
  # Positions of a row (under context parallelism, of a chunk) Qwen3.5's layers work on at once: a longer one runs
  # as a scan over spans of about this many (the Gated DeltaNet layer whole, the gated attention's output projection),
  # each span's temporaries live in turn, not the row's (backward recomputes a span at a time: more compute, far less
  # memory; `models.spans`). 0: whole rows. The planner shortens it where nothing else fits.
  sequence_span_tokens: int = SPAN_TOKENS
  # Run each stretch of consecutive layers of one kind as one `lax.scan` over parameters stacked on a leading
  # axis: one layer is traced and compiled whatever the depth (a ring layer takes about a minute to compile on a
  # GPU). False: a Python loop over layers, each compiled on its own, which lets XLA overlap across layers.
  # Stacking changes the parameters' layout, so a checkpoint restores only under the value it was written with.
  scan_layers: bool = True
  dtype: str = "bfloat16"  # of the compute (float32, bfloat16, float16); parameters keep model.param_dtype

  def __post_init__(self):
    object.__setattr__(self, "dispatcher_options", tuple(sorted(dict(self.dispatcher_options).items())))
    if isinstance(self.remat, list):  # one policy a layer, as Python code writes it: stored hashable, as YAML's
      object.__setattr__(self, "remat", tuple(self.remat))
    if self.dispatcher not in rm.DISPATCHERS:
      raise UserError(f"unknown dispatcher {self.dispatcher!r}; known: {sorted(rm.DISPATCHERS)}")
    policies = self.remat if isinstance(self.remat, tuple) else (self.remat,)
    unknown = sorted(set(policies) - set(REMAT_POLICIES) - ({REMAT_AUTO} if self.remat == REMAT_AUTO else set()))
    if unknown:
      raise UserError(f"remat {unknown} unknown; each layer's is one of {list(REMAT_POLICIES)} (or auto for "
                      "every layer)")
    if self.loss_chunk_tokens != LOSS_CHUNK_AUTO and not (isinstance(self.loss_chunk_tokens, int)
                                                          and self.loss_chunk_tokens >= 0):
      raise UserError(f"loss_chunk_tokens={self.loss_chunk_tokens!r} must be an integer ≥ 0 (0: full logits) or "
                      f"{LOSS_CHUNK_AUTO!r}")
    if self.attention_implementation not in ("auto", "xla", "cudnn"):
      raise UserError(f"attention_implementation={self.attention_implementation!r} must be auto, xla or cudnn")
    if self.documents_per_row != DOCUMENTS_AUTO and not (isinstance(self.documents_per_row, int)
                                                          and self.documents_per_row >= 2):
      raise UserError(f"documents_per_row={self.documents_per_row!r} must be an integer ≥ 2 (cuDNN's packed layout) "
                      f"or {DOCUMENTS_AUTO!r}")
    if not (isinstance(self.sequence_span_tokens, int) and self.sequence_span_tokens >= 0):
      raise UserError(f"sequence_span_tokens={self.sequence_span_tokens!r} must be an integer ≥ 0 (0: whole rows)")
    if self.dtype not in FLOAT_DTYPES:
      raise UserError(f"dtype={self.dtype!r} (the compute dtype) must be one of {list(FLOAT_DTYPES)}")

  def loss_chunk(self):
    """Tokens per device per chunk of the loss head (0: the plain loss), with "auto" not resolved: the default."""
    return DEFAULT_LOSS_CHUNK_TOKENS if self.loss_chunk_tokens == LOSS_CHUNK_AUTO else self.loss_chunk_tokens

  def packed_documents(self):
    """M of cuDNN's packed layout, with "auto" not resolved: DOCUMENTS_PER_ROW."""
    return DOCUMENTS_PER_ROW if self.documents_per_row == DOCUMENTS_AUTO else self.documents_per_row

  def remat_of(self, layer):
    return self.remat if isinstance(self.remat, str) else self.remat[layer]

  def check(self, config):
    """Raises ValueError where this runtime does not fit the architecture (or is not resolved yet)."""
    if self.remat == REMAT_AUTO:
      raise ValueError("remat=auto is resolved by the planner (`train.plan.planner.resolve_remat`) before a model is built")
    if isinstance(self.remat, tuple) and len(self.remat) != config.num_hidden_layers:
      raise UserError(f"remat has {len(self.remat)} entries for {config.num_hidden_layers} layers")


RUNTIME_FIELDS = frozenset(f.name for f in dataclasses.fields(RuntimeConfig))


def split_legacy(data):
  """(architecture, runtime) mappings of a model mapping written before the two configs were split (a
  `model.yaml` of `relaymoe-convert`, the `model` of a run's `run_config.json`): runtime keys move out."""
  return ({k: v for k, v in data.items() if k not in RUNTIME_FIELDS},
          {k: v for k, v in data.items() if k in RUNTIME_FIELDS})


class LayerGroup(NamedTuple):
  """Layers a model runs together: `count` repeats of a unit of `period` consecutive layers from `first` (one
  `LayerStack` under `scan_layers`; a lone layer is a group of one)."""
  first: int
  count: int
  period: int = 1

  def layers(self, offset=0):
    """The layers at `offset` in each repeat of the unit, in order."""
    return [self.first + i * self.period + offset for i in range(self.count)]

