"""`Qwen3MoEConfig`: the architecture of Qwen3-MoE and Qwen2-MoE (what a Hugging Face `config.json` says, and what
a checkpoint's `model.yaml` holds); how it runs is `models.runtime.RuntimeConfig`."""

import dataclasses

from models.config import from_mapping, read_yaml
from models.runtime import FLOAT_DTYPES, RUNTIME_FIELDS, LayerGroup, RuntimeConfig
from relaymoe_jax.errors import UserError

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
    if not 0 <= self.router_bias_update_rate < float("inf"):  # NaN fails too
      raise UserError(f"router_bias_update_rate={self.router_bias_update_rate} must be finite and ≥ 0 (0: off)")
    if self.head_dim % 2:
      raise UserError(f"head_dim={self.head_dim} must be even for RoPE")

  def layer_groups(self, runtime):
    return layer_groups(self, runtime)

  def is_sparse(self, layer):
    return (layer not in self.mlp_only_layers and self.num_experts > 0
            and (layer + 1) % self.decoder_sparse_step == 0)


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
  return [LayerGroup(*g) for g in groups]


def load_config(path_or_name, **overrides) -> Qwen3MoEConfig:
  """A model config from a YAML file or a name under configs/models/ (e.g. "qwen3-30b-a3b", "tiny")."""
  data = dict(read_yaml(path_or_name, "models"), **overrides)
  runtime_keys = sorted(RUNTIME_FIELDS & set(data))
  if runtime_keys:
    raise UserError(f"model config {path_or_name}: {runtime_keys} say how the model runs, not what it is: set "
                    f"them as runtime.KEY (the run config's `runtime` section or a `runtime.KEY=VALUE` override)")
  return from_mapping(Qwen3MoEConfig, data, f"model config {path_or_name}")
