"""The model's two configs: `Qwen3MoEConfig`, its architecture (what a Hugging Face `config.json` says, and what a
checkpoint's `model.yaml` holds), and `RuntimeConfig`, how it runs (dispatcher, recompute, loss chunking, attention
kernel, sharding choices, layer scan, compute dtype), which a run config holds and the planner edits."""

import dataclasses

import relaymoe_jax as rm
from models.config import from_mapping, read_yaml
from relaymoe_jax.errors import UserError

# What a layer's backward recomputes, from the most memory to the least:
#   none       every activation the layer's backward needs is kept from the forward;
#   attention  attention is recomputed (its inputs are kept); the MoE keeps its residuals (x, pair plan);
#   all_but_attention  as `layer`, but the attention kernel's output and softmax statistics are kept too, so
#              backward reruns the layer's forward but not its attention kernel (`models/remat.py`);
#   layer      only the layer's input is kept; backward reruns the whole layer's forward (the ring included);
#   offload    as `layer`, with that input kept in host memory (`pinned_host`) instead of on the device.
REMAT_POLICIES = ("none", "attention", "all_but_attention", "layer", "offload")
REMAT_AUTO = "auto"  # a run's request for the planner (`train.plan`), resolved before the model is built
LOSS_CHUNK_AUTO = "auto"  # the trainer's choice (`train.loss_chunk`); elsewhere the default below
DEFAULT_LOSS_CHUNK_TOKENS = 1024
FLOAT_DTYPES = ("float32", "bfloat16", "float16")  # of the parameters and of the compute
# Sizes of the architecture that are at least 1 (a 0 divides by zero or builds an empty model that trains).
POSITIVE = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "num_experts", "decoder_sparse_step")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Qwen3MoEConfig:
  """Architecture, with Hugging Face Qwen3MoeConfig / Qwen2MoeConfig names."""

  vocab_size: int
  hidden_size: int
  intermediate_size: int  # dense-MLP layers
  moe_intermediate_size: int
  num_hidden_layers: int
  num_attention_heads: int
  num_key_value_heads: int
  head_dim: int
  num_experts: int
  num_experts_per_tok: int
  norm_topk_prob: bool = True
  rms_norm_eps: float = 1e-6
  rope_theta: float = 1_000_000.0
  decoder_sparse_step: int = 1
  mlp_only_layers: tuple[int, ...] = ()
  attention_bias: bool = False  # Qwen2-MoE: q/k/v biases
  qk_norm: bool = True  # Qwen3: RMSNorm on q and k heads; Qwen2-MoE: none
  shared_expert_intermediate_size: int = 0  # Qwen2-MoE shared expert with a sigmoid gate; 0 = none
  tie_word_embeddings: bool = False
  router_aux_loss_coef: float = 0.001
  router_z_loss_coef: float = 0.0
  # Auxiliary-loss-free balancing (DeepSeek-V3): a per-expert bias on the router's probabilities, for the choice of
  # experts only, moved by this rate × sign(mean load − load) after every training step. 0: no bias (Qwen3).
  router_bias_update_rate: float = 0.0
  initializer_range: float = 0.02
  param_dtype: str = "float32"  # how the parameters are stored (Hugging Face's torch_dtype)

  def __post_init__(self):
    below = [f"{k}={getattr(self, k)}" for k in POSITIVE if getattr(self, k) < 1]
    if below:
      raise UserError(f"{', '.join(below)}: must be ≥ 1")
    if self.shared_expert_intermediate_size < 0:
      raise UserError(f"shared_expert_intermediate_size={self.shared_expert_intermediate_size} must be ≥ 0 (0: none)")
    beyond = [layer for layer in self.mlp_only_layers if not 0 <= layer < self.num_hidden_layers]
    if beyond:
      raise UserError(f"mlp_only_layers {beyond} are not layers of the {self.num_hidden_layers} (0 to "
                      f"{self.num_hidden_layers - 1})")
    if self.param_dtype not in FLOAT_DTYPES:
      raise UserError(f"param_dtype={self.param_dtype!r} must be one of {list(FLOAT_DTYPES)}")
    if self.num_attention_heads % self.num_key_value_heads:
      raise UserError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                      f"num_key_value_heads={self.num_key_value_heads}")
    if not 1 <= self.num_experts_per_tok <= self.num_experts:
      raise UserError(f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, num_experts="
                      f"{self.num_experts}]")
    if not self.router_bias_update_rate >= 0:  # NaN fails too
      raise UserError(f"router_bias_update_rate={self.router_bias_update_rate} must be ≥ 0 (0: off)")
    if self.head_dim % 2:
      raise UserError(f"head_dim={self.head_dim} must be even for RoPE")

  def is_sparse(self, layer):
    return (layer not in self.mlp_only_layers and self.num_experts > 0
            and (layer + 1) % self.decoder_sparse_step == 0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RuntimeConfig:
  """How the model runs: nothing here changes what it computes (up to the compute dtype's rounding)."""

  # MoE block: dispatcher name and its own options (chunk_rows, capacity_factor, backend, ...).
  dispatcher: str = "ring_expert"
  dispatcher_options: tuple = ()  # given as a mapping in YAML; stored as sorted (key, value) pairs (hashable)
  # What backward recomputes, for every layer or one entry per layer (`REMAT_POLICIES`); "auto": the planner
  # (`train.plan`) chooses from the compiled step's memory before the model is built.
  remat: str | tuple[str, ...] = "none"
  # Tokens per device per chunk of the loss head (`models.loss`): the float32 logits are never whole. 0: the
  # plain loss over full logits. "auto": the trainer takes the largest chunk whose compiled step needs no more
  # memory than at DEFAULT_LOSS_CHUNK_TOKENS (`train.loss_chunk`); a model built with "auto" uses the default.
  loss_chunk_tokens: int | str = LOSS_CHUNK_AUTO
  # "auto": cuDNN flash attention on GPUs for bf16/f16 (625 TFLOP/s on H200 against 39 for XLA's), else XLA.
  attention_implementation: str = "auto"
  # Split the parameters outside the experts (attention, embeddings, dense and shared MLPs) over ('data',
  # 'expert'), every device they would otherwise be replicated on (ZeRO-3); experts are split over 'expert' anyway.
  fsdp: bool = False
  moe_tensor_parallel: bool = False  # split F of every expert over 'tensor' (expert tensor parallelism)
  # Split each sequence over 'expert' (batch rows over 'data' only) in load-balanced causal order; attention
  # gathers K and V across the shards (`models.context_parallel`). seq_len must divide by 2 × expert.
  context_parallel: bool = False
  # Run each stretch of consecutive layers of one kind as one `lax.scan` over parameters stacked on a leading
  # axis: one layer is traced and compiled whatever the depth (a ring layer takes about a minute to compile on a
  # GPU). False: a Python loop over layers, each compiled on its own, which lets XLA overlap across layers.
  # Stacking changes the parameters' layout, so a checkpoint restores only under the value it was written with.
  scan_layers: bool = True
  dtype: str = "bfloat16"  # compute

  def __post_init__(self):
    object.__setattr__(self, "dispatcher_options", tuple(sorted(dict(self.dispatcher_options).items())))
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
    if self.dtype not in FLOAT_DTYPES:
      raise UserError(f"dtype={self.dtype!r} (the compute dtype) must be one of {list(FLOAT_DTYPES)}")

  def loss_chunk(self):
    """Tokens per device per chunk of the loss head (0: the plain loss), with "auto" not resolved: the default."""
    return DEFAULT_LOSS_CHUNK_TOKENS if self.loss_chunk_tokens == LOSS_CHUNK_AUTO else self.loss_chunk_tokens

  def remat_of(self, layer):
    return self.remat if isinstance(self.remat, str) else self.remat[layer]

  def check(self, config: Qwen3MoEConfig):
    """Raises ValueError where this runtime does not fit the architecture (or is not resolved yet)."""
    if self.remat == REMAT_AUTO:
      raise ValueError("remat=auto is resolved by the planner (`train.plan.resolve_remat`) before a model is built")
    if isinstance(self.remat, tuple) and len(self.remat) != config.num_hidden_layers:
      raise UserError(f"remat has {len(self.remat)} entries for {config.num_hidden_layers} layers")


RUNTIME_FIELDS = frozenset(f.name for f in dataclasses.fields(RuntimeConfig))


def layer_groups(config: Qwen3MoEConfig, runtime: RuntimeConfig):
  """(first layer, count) of the layers run together: each stretch of consecutive layers of one kind (MoE or
  dense MLP, one remat policy) with `scan_layers`, else each layer alone."""
  runtime.check(config)

  def kind(layer):
    return config.is_sparse(layer), runtime.remat_of(layer)

  groups = []
  for layer in range(config.num_hidden_layers):
    if groups and runtime.scan_layers and kind(layer) == kind(groups[-1][0]):
      groups[-1][1] += 1
    else:
      groups.append([layer, 1])
  return [tuple(g) for g in groups]


def split_legacy(data):
  """(architecture, runtime) mappings of a model mapping written before the two configs were split (a
  `model.yaml` of `relaymoe-convert`, the `model` of a run's `run_config.json`): runtime keys move out."""
  return ({k: v for k, v in data.items() if k not in RUNTIME_FIELDS},
          {k: v for k, v in data.items() if k in RUNTIME_FIELDS})


def load_config(path_or_name, **overrides) -> Qwen3MoEConfig:
  """A model config from a YAML file or a name under configs/models/ (e.g. "qwen3-30b-a3b", "tiny")."""
  data = dict(read_yaml(path_or_name, "models"), **overrides)
  runtime_keys = sorted(RUNTIME_FIELDS & set(data))
  if runtime_keys:
    raise UserError(f"model config {path_or_name}: {runtime_keys} say how the model runs, not what it is: set "
                    f"them as runtime.KEY (the run config's `runtime` section or a `runtime.KEY=VALUE` override)")
  return from_mapping(Qwen3MoEConfig, data, f"model config {path_or_name}")
