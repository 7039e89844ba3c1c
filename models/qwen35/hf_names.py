"""Which Hugging Face tensor each Qwen3.5 parameter comes from (`models.hf.transfer`'s import and export), in the
relations of `models.qwen3.hf_names` (copy, T, experts, gate/up, down; here also `conv`: conv1d's [C, 1, W] weight
without its middle axis). Keys start with the checkpoint's text prefix (`model.` or `model.language_model.`)."""

import dataclasses

from models.qwen3 import model as qwen3
from models.qwen3.hf_names import FUSED_EXPERTS, PER_EXPERT, ROUTER, SHARED_EXPERT, Source, Param

_NORMS = {("input_norm", "weight"): Source("input_layernorm.weight", "copy"),
          ("post_attention_norm", "weight"): Source("post_attention_layernorm.weight", "copy")}
_ATTENTION = {("attn", "q_gate_DH"): Source("self_attn.q_proj.weight", "T"),
              ("attn", "k_DG"): Source("self_attn.k_proj.weight", "T"),
              ("attn", "v_DG"): Source("self_attn.v_proj.weight", "T"),
              ("attn", "o_HD"): Source("self_attn.o_proj.weight", "T"),
              ("attn", "q_norm", "weight"): Source("self_attn.q_norm.weight", "copy"),
              ("attn", "k_norm", "weight"): Source("self_attn.k_norm.weight", "copy")}
_DELTA = {("attn", "in_qkv_DC"): Source("linear_attn.in_proj_qkv.weight", "T"),
          ("attn", "in_z_DC"): Source("linear_attn.in_proj_z.weight", "T"),
          ("attn", "in_b_DC"): Source("linear_attn.in_proj_b.weight", "T"),
          ("attn", "in_a_DC"): Source("linear_attn.in_proj_a.weight", "T"),
          ("attn", "conv_CW"): Source("linear_attn.conv1d.weight", "conv"),
          ("attn", "a_log_Q"): Source("linear_attn.A_log", "copy"),
          ("attn", "dt_bias_Q"): Source("linear_attn.dt_bias", "copy"),
          ("attn", "norm_X"): Source("linear_attn.norm.weight", "copy"),
          ("attn", "out_CD"): Source("linear_attn.out_proj.weight", "T")}


def layer_sources(config, layer, prefix, fused=False):
  """{our path inside one DecoderLayer: Source with the full Hugging Face key} for `layer`."""
  table = {**_NORMS, **(_DELTA if config.is_linear(layer) else _ATTENTION), **ROUTER,
           **(FUSED_EXPERTS if fused else PER_EXPERT)}
  if config.shared_expert_intermediate_size:
    table.update(SHARED_EXPERT)
  return {path: dataclasses.replace(s, key=f"{prefix}layers.{layer}.{s.key}") for path, s in table.items()}


def top_sources(prefix):
  return {("embed_VD",): Source(f"{prefix}embed_tokens.weight", "copy"),
          ("norm", "weight"): Source(f"{prefix}norm.weight", "copy"), ("lm_head_DV",): Source("lm_head.weight", "T")}


def _layers_of_path(groups, path):
  """(layers, path inside the layer, stacked) of a parameter path, or (None, path, False) at top level."""
  if path[0] != "layers":
    return None, path, False
  group = groups[path[1]]
  inner, stacked = path[2:], path[2] == qwen3.STACKED
  if stacked:
    inner = inner[1:]
  offset = 0
  if group.period > 1:  # a block's layers: [layers, offset, ...]
    offset, inner = inner[1], inner[2:]
  return (group.layers(offset) if stacked else [group.first + offset]), inner, stacked


def param_sources(config, runtime, paths, prefix="model.", fused_layers=frozenset()):
  """{our parameter path: Param} for every path in `paths` of a model of `config` laid out as `runtime` says."""
  groups = config.layer_groups(runtime)
  out = {}
  for path in paths:
    layers, inner, stacked = _layers_of_path(groups, path)
    if layers is None:
      out[path] = Param((top_sources(prefix)[inner],), False)
      continue
    out[path] = Param(tuple(layer_sources(config, layer, prefix, layer in fused_layers)[inner] for layer in layers),
                       stacked)
  return out
