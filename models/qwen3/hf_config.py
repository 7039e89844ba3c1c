"""Hugging Face `config.json` of Qwen3-MoE (`qwen3_moe`) and Qwen2-MoE (`qwen2_moe`) to and from our architecture
config (`Qwen3MoEConfig`). No arrays: `models.hf.transfer` reads and writes the tensors."""

from models.config import from_mapping, read_hf_config
from models.qwen3.config import Qwen3MoEConfig
from relaymoe_jax.errors import UserError

FAMILIES = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}
# Hugging Face config defaults where a config.json leaves a key out (both families share them).
_HF_DEFAULTS = dict(decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=False, tie_word_embeddings=False,
                    rms_norm_eps=1e-6, rope_theta=10000.0, router_aux_loss_coef=0.001, initializer_range=0.02)
_REQUIRED_BOTH = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_experts_per_tok")
_REQUIRED = {"qwen3_moe": _REQUIRED_BOTH, "qwen2_moe": _REQUIRED_BOTH + ("shared_expert_intermediate_size",)}


def config_from_hf(hf_dir, **overrides) -> Qwen3MoEConfig:
  """Our config from a Hugging Face `config.json` (model_type qwen3_moe or qwen2_moe), `overrides` on top.

  Args:
    hf_dir: a directory holding `config.json`.
    **overrides: any `Qwen3MoEConfig` field (param_dtype, rms_norm_eps, ...), applied last; how the model runs
      is a `RuntimeConfig`, not part of it.

  Raises:
    ValueError: an unknown model_type (named), a feature the model does not have (sliding window, RoPE scaling,
      an activation other than SiLU, Qwen3 attention biases, which include o_proj's), or a bad override.
  """
  hf, path = read_hf_config(hf_dir)
  model_type = hf.get("model_type")
  if model_type not in FAMILIES:
    raise UserError(f"{path}: model_type {model_type!r} is not supported; known: {sorted(FAMILIES)}")
  _check_supported(hf, path)

  def get(key):
    return hf[key] if hf.get(key) is not None else _HF_DEFAULTS[key]

  missing = [k for k in _REQUIRED[model_type] if hf.get(k) is None]
  if hf.get("num_experts", hf.get("num_local_experts")) is None:
    missing.append("num_experts")
  if missing:
    raise UserError(f"{path}: missing key(s) {missing}")
  heads = hf["num_attention_heads"]
  fields = dict(
      vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], intermediate_size=hf["intermediate_size"],
      moe_intermediate_size=hf["moe_intermediate_size"], num_hidden_layers=hf["num_hidden_layers"],
      num_attention_heads=heads, num_key_value_heads=hf.get("num_key_value_heads") or heads,
      head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
      num_experts=hf.get("num_experts", hf.get("num_local_experts")),  # transformers 5 writes num_local_experts
      num_experts_per_tok=hf["num_experts_per_tok"], norm_topk_prob=get("norm_topk_prob"),
      rms_norm_eps=get("rms_norm_eps"), rope_theta=_rope_theta(hf), decoder_sparse_step=get("decoder_sparse_step"),
      mlp_only_layers=list(get("mlp_only_layers")), tie_word_embeddings=get("tie_word_embeddings"),
      router_aux_loss_coef=get("router_aux_loss_coef"), initializer_range=get("initializer_range"))
  if model_type == "qwen2_moe":
    fields.update(attention_bias=hf.get("qkv_bias", True), qk_norm=False,
                  shared_expert_intermediate_size=hf["shared_expert_intermediate_size"])
  return from_mapping(Qwen3MoEConfig, dict(fields, **overrides), f"Hugging Face config {path}")


def _check_supported(hf, path):
  if hf.get("use_sliding_window"):
    raise UserError(f"{path}: use_sliding_window=true is not supported (full causal attention only)")
  if hf.get("hidden_act", "silu") != "silu":
    raise UserError(f"{path}: hidden_act={hf['hidden_act']!r} is not supported (SiLU only)")
  if hf["model_type"] == "qwen3_moe" and hf.get("attention_bias"):
    raise UserError(f"{path}: attention_bias=true is not supported for qwen3_moe (it adds an o_proj bias)")
  rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
  kind = rope.get("rope_type", rope.get("type", "default"))
  if kind != "default":
    raise UserError(f"{path}: RoPE scaling {kind!r} is not supported (default RoPE only)")


def _rope_theta(hf):
  """rope_theta at the top level (transformers 4) or inside rope_parameters (transformers 5)."""
  if hf.get("rope_theta") is not None:
    return hf["rope_theta"]
  return (hf.get("rope_parameters") or {}).get("rope_theta", _HF_DEFAULTS["rope_theta"])


def config_to_hf(config) -> dict:
  """The `config.json` of a Hugging Face checkpoint of `config`: qwen2_moe where it has a shared expert and no
  q/k norm, qwen3_moe where it has q/k norm and neither a shared expert nor biases; anything else raises."""
  c = config
  qwen2 = not c.qk_norm and c.shared_expert_intermediate_size > 0
  qwen3_ = c.qk_norm and not c.shared_expert_intermediate_size and not c.attention_bias
  if not (qwen2 or qwen3_):
    raise UserError(f"no Hugging Face family holds qk_norm={c.qk_norm}, attention_bias={c.attention_bias}, "
                    f"shared_expert_intermediate_size={c.shared_expert_intermediate_size}: qwen3_moe has q/k norm "
                    "and neither biases nor a shared expert; qwen2_moe has a shared expert and no q/k norm")
  model_type = "qwen2_moe" if qwen2 else "qwen3_moe"
  out = dict(
      architectures=[FAMILIES[model_type]], model_type=model_type, vocab_size=c.vocab_size,
      hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, moe_intermediate_size=c.moe_intermediate_size,
      num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
      num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, num_experts=c.num_experts,
      num_experts_per_tok=c.num_experts_per_tok, norm_topk_prob=c.norm_topk_prob, rms_norm_eps=c.rms_norm_eps,
      rope_theta=c.rope_theta, rope_parameters=dict(rope_type="default", rope_theta=c.rope_theta),
      decoder_sparse_step=c.decoder_sparse_step, mlp_only_layers=list(c.mlp_only_layers),
      tie_word_embeddings=c.tie_word_embeddings, router_aux_loss_coef=c.router_aux_loss_coef,
      initializer_range=c.initializer_range, hidden_act="silu", use_sliding_window=False,
      torch_dtype=c.param_dtype, dtype=c.param_dtype)  # transformers 4 reads torch_dtype, 5 dtype
  if qwen2:
    out.update(qkv_bias=c.attention_bias, shared_expert_intermediate_size=c.shared_expert_intermediate_size)
  else:
    out.update(attention_bias=False)
  return out
