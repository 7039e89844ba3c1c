"""Hugging Face `config.json` of Qwen3.5-MoE to and from `Qwen35MoEConfig`: the text model's own
(`qwen3_5_moe_text`) or the multimodal checkpoint's `text_config` (`qwen3_5_moe`, what the Hub ships). No arrays:
`models.hf.transfer` reads and writes the tensors."""

from models.config import from_mapping
from models.qwen35.config import MODEL_TYPE, Qwen35MoEConfig
from relaymoe_jax.errors import UserError

MULTIMODAL = "qwen3_5_moe"
MODEL_TYPES = (MODEL_TYPE, MULTIMODAL)
# Where the text model's tensors are in each checkpoint; the multimodal one also ships these, which the text model
# does not use (transformers ignores them too).
TEXT_PREFIX = {MODEL_TYPE: "model.", MULTIMODAL: "model.language_model."}
LEFT_OUT = {MODEL_TYPE: ("mtp.",), MULTIMODAL: ("mtp.", "model.visual.")}
_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "layer_types", "full_attention_interval",
           "num_attention_heads", "num_key_value_heads", "head_dim", "linear_conv_kernel_dim", "linear_key_head_dim",
           "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads", "moe_intermediate_size",
           "shared_expert_intermediate_size", "num_experts", "num_experts_per_tok", "rms_norm_eps",
           "tie_word_embeddings", "router_aux_loss_coef", "initializer_range")


def text_config(hf, path):
  """The text model's keys of a `config.json` mapping (the multimodal one's `text_config`)."""
  if hf.get("model_type") == MULTIMODAL:
    if not isinstance(hf.get("text_config"), dict):
      raise UserError(f"{path}: a {MULTIMODAL} config without a text_config object")
    return dict(hf["text_config"], tie_word_embeddings=hf.get("tie_word_embeddings", False))
  return hf


def config_from_hf(hf, path, **overrides) -> Qwen35MoEConfig:
  """Our config from a parsed `config.json` (`hf`, read from `path`), `overrides` (our fields) on top."""
  text = text_config(hf, path)
  if text.get("hidden_act", "silu") != "silu":
    raise UserError(f"{path}: hidden_act={text['hidden_act']!r} is not supported (SiLU only)")
  if text.get("attention_bias"):
    raise UserError(f"{path}: attention_bias=true is not supported (Qwen3.5 has no attention biases)")
  rope = text.get("rope_parameters") or {}
  if rope.get("rope_type", "default") != "default":
    raise UserError(f"{path}: RoPE {rope['rope_type']!r} is not supported (default RoPE only)")
  fields = {k: text[k] for k in _FIELDS if text.get(k) is not None}
  fields.update(rope_theta=rope.get("rope_theta", text.get("rope_theta", 10000.0)),
                partial_rotary_factor=rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25)))
  return from_mapping(Qwen35MoEConfig, dict(fields, **overrides), f"Hugging Face config {path}")


def config_to_hf(config) -> dict:
  """The `config.json` of a text-only Hugging Face checkpoint of `config` (`Qwen3_5MoeForCausalLM`)."""
  c = config
  out = {k: getattr(c, k) for k in _FIELDS}
  out.update(architectures=["Qwen3_5MoeForCausalLM"], model_type=MODEL_TYPE, layer_types=list(c.layer_types),
             hidden_act="silu", attention_bias=False, torch_dtype=c.param_dtype, dtype=c.param_dtype,
             rope_parameters=dict(rope_type="default", rope_theta=c.rope_theta,
                                  partial_rotary_factor=c.partial_rotary_factor))
  return out
