"""`Qwen35MoEConfig`: the architecture of Qwen3.5-MoE (Hugging Face `qwen3_5_moe_text`, the text model of
`qwen3_5_moe`): a hybrid decoder of Gated DeltaNet layers and gated full-attention layers, every layer MoE with a
sigmoid-gated shared expert. How it runs is `models.runtime.RuntimeConfig`."""

import dataclasses

from models.config import from_mapping, read_yaml
from models.runtime import FLOAT_DTYPES, RUNTIME_FIELDS, LayerGroup
from relaymoe_jax.errors import UserError

LINEAR, FULL = "linear_attention", "full_attention"  # Hugging Face's `layer_types` entries
MODEL_TYPE = "qwen3_5_moe_text"  # the key a model YAML names this family by (`model_type:`)
POSITIVE = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
            "linear_num_key_heads", "linear_num_value_heads", "moe_intermediate_size", "num_experts",
            "num_experts_per_tok", "full_attention_interval")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Qwen35MoEConfig:
  """Architecture, with Hugging Face Qwen3_5MoeTextConfig names (`rope_theta` and `partial_rotary_factor` are
  its `rope_parameters`' entries)."""

  model_type: str = MODEL_TYPE
  vocab_size: int
  hidden_size: int
  num_hidden_layers: int
  # One entry per layer, LINEAR (Gated DeltaNet) or FULL (gated attention); empty: FULL every
  # `full_attention_interval`-th layer, LINEAR otherwise (as transformers derives it).
  layer_types: tuple[str, ...] = ()
  full_attention_interval: int = 4
  num_attention_heads: int
  num_key_value_heads: int
  head_dim: int
  partial_rotary_factor: float = 0.25  # RoPE on the first head_dim × this dims of q and k
  rope_theta: float = 10_000_000.0  # the released checkpoint's (transformers' class default is 1e4)
  linear_conv_kernel_dim: int = 4
  linear_key_head_dim: int
  linear_value_head_dim: int
  linear_num_key_heads: int
  linear_num_value_heads: int
  moe_intermediate_size: int
  shared_expert_intermediate_size: int = 0  # one shared expert with a sigmoid gate; 0 = none
  num_experts: int
  num_experts_per_tok: int
  rms_norm_eps: float = 1e-6
  tie_word_embeddings: bool = False
  router_aux_loss_coef: float = 0.001
  router_z_loss_coef: float = 0.0
  router_bias_update_rate: float = 0.0  # auxiliary-loss-free balancing, as `Qwen3MoEConfig`'s
  initializer_range: float = 0.02
  param_dtype: str = "float32"

  norm_topk_prob = True  # always renormalised (a class constant: transformers has no such field for Qwen3.5)

  def __post_init__(self):
    if self.model_type != MODEL_TYPE:
      raise UserError(f"model_type={self.model_type!r}: this config is {MODEL_TYPE!r}")
    below = [f"{k}={getattr(self, k)}" for k in POSITIVE if getattr(self, k) < 1]
    if below:
      raise UserError(f"{', '.join(below)}: must be ≥ 1")
    if not self.layer_types:
      object.__setattr__(self, "layer_types", tuple(
          FULL if (i + 1) % self.full_attention_interval == 0 else LINEAR for i in range(self.num_hidden_layers)))
    object.__setattr__(self, "layer_types", tuple(self.layer_types))
    unknown = sorted(set(self.layer_types) - {LINEAR, FULL})
    if unknown:
      raise UserError(f"layer_types {unknown} unknown; each is {LINEAR!r} or {FULL!r}")
    if len(self.layer_types) != self.num_hidden_layers:
      raise UserError(f"layer_types has {len(self.layer_types)} entries for num_hidden_layers="
                      f"{self.num_hidden_layers}")
    if self.num_attention_heads % self.num_key_value_heads:
      raise UserError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                      f"num_key_value_heads={self.num_key_value_heads}")
    if self.linear_num_value_heads % self.linear_num_key_heads:
      raise UserError(f"linear_num_value_heads={self.linear_num_value_heads} is not a multiple of "
                      f"linear_num_key_heads={self.linear_num_key_heads}")
    if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2:
      raise UserError(f"partial_rotary_factor={self.partial_rotary_factor} must give an even number of rotary "
                      f"dims in (0, head_dim={self.head_dim}] (got {self.rotary_dim})")
    if not 1 <= self.num_experts_per_tok <= self.num_experts:
      raise UserError(f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, num_experts="
                      f"{self.num_experts}]")
    if self.shared_expert_intermediate_size < 0:
      raise UserError(f"shared_expert_intermediate_size={self.shared_expert_intermediate_size} must be ≥ 0")
    if not 0 <= self.router_bias_update_rate < float("inf"):
      raise UserError(f"router_bias_update_rate={self.router_bias_update_rate} must be finite and ≥ 0 (0: off)")
    if self.param_dtype not in FLOAT_DTYPES:
      raise UserError(f"param_dtype={self.param_dtype!r} must be one of {list(FLOAT_DTYPES)}")

  @property
  def rotary_dim(self):
    return int(self.head_dim * self.partial_rotary_factor)

  def layer_groups(self, runtime):
    return layer_groups(self, runtime)

  def is_sparse(self, layer):
    del layer
    return True  # every layer's MLP is the MoE block

  def is_linear(self, layer):
    return self.layer_types[layer] == LINEAR


def layer_groups(config: Qwen35MoEConfig, runtime):
  """The layers run together: with `scan_layers`, repeats of the layer-type pattern (its period, e.g. 3 DeltaNet +
  1 attention) whose layers share remat policies, each stretch one group; else each layer alone."""
  runtime.check(config)
  n = config.num_hidden_layers
  if not runtime.scan_layers:
    return [LayerGroup(layer, 1) for layer in range(n)]
  period = next(p for p in range(1, n + 1)
                if all(config.layer_types[i] == config.layer_types[i % p] for i in range(n)))
  kind = lambda first, p: tuple((config.layer_types[i], runtime.remat_of(i)) for i in range(first, first + p))
  groups, layer = [], 0
  while layer < n:
    p = min(period, n - layer)
    last = groups[-1] if groups else None
    if last and last.period == p and kind(last.first, p) == kind(layer, p):
      groups[-1] = last._replace(count=last.count + 1)
    else:
      groups.append(LayerGroup(layer, 1, p))
    layer += p
  return groups


def load_mapping(data, where):
  """The config of a model mapping (a YAML's, `model_type` included)."""
  runtime_keys = sorted(RUNTIME_FIELDS & set(data))
  if runtime_keys:
    raise UserError(f"{where}: {runtime_keys} say how the model runs, not what it is: set them as runtime.KEY")
  return from_mapping(Qwen35MoEConfig, data, where)


def load_config(path_or_name, **overrides) -> Qwen35MoEConfig:
  """A Qwen3.5 model config from a YAML file or a name under configs/models/."""
  return load_mapping(dict(read_yaml(path_or_name, "models"), **overrides), f"model config {path_or_name}")
