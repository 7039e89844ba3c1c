"""Which Hugging Face tensor(s) each of our parameters comes from and how (`models.hf.transfer`'s import and export): per
decoder layer (`layer_sources`), for each parameter of a model as its runtime lays it out (`param_sources`, stacked
layers one Source per layer), and the Hugging Face shapes that implies (`hf_shapes`).

How an array of ours relates to its Hugging Face tensor(s):
  copy     the same array;
  T        a torch Linear's [out, in] weight, transposed;
  experts  one [out, in] tensor per expert ("{e}" in the key), each transposed, stacked on a leading E axis;
  gate/up  the first/second half of the rows of fused gate_up_proj [E, 2F, D], each expert transposed;
  down     fused down_proj [E, D, F], each expert transposed.
"""

import dataclasses

import jax

from models.qwen3 import model as qwen3
from models.qwen3.config import layer_groups


@dataclasses.dataclass(frozen=True)
class Source:
  """The Hugging Face tensor (`key`, "{e}" per expert for `experts`) and relation (`how`) of one of our arrays."""
  key: str
  how: str


_ATTENTION = {
    ("input_norm", "weight"): Source("input_layernorm.weight", "copy"),
    ("post_attention_norm", "weight"): Source("post_attention_layernorm.weight", "copy"),
    ("attn", "q_DH"): Source("self_attn.q_proj.weight", "T"),
    ("attn", "k_DG"): Source("self_attn.k_proj.weight", "T"),
    ("attn", "v_DG"): Source("self_attn.v_proj.weight", "T"),
    ("attn", "o_HD"): Source("self_attn.o_proj.weight", "T"),
}
_BIASES = {("attn", f"{n}_bias"): Source(f"self_attn.{n}_proj.bias", "copy") for n in "qkv"}
_QK_NORM = {("attn", f"{n}_norm", "weight"): Source(f"self_attn.{n}_norm.weight", "copy") for n in "qk"}
_DENSE = {("mlp", "gate_DF"): Source("mlp.gate_proj.weight", "T"), ("mlp", "up_DF"): Source("mlp.up_proj.weight", "T"),
          ("mlp", "down_FD"): Source("mlp.down_proj.weight", "T")}
ROUTER = {("mlp", "router_DE"): Source("mlp.gate.weight", "T")}
PER_EXPERT = {("mlp", f"w_{n}_E{s}"): Source(f"mlp.experts.{{e}}.{n}_proj.weight", "experts")
               for n, s in (("gate", "DF"), ("up", "DF"), ("down", "FD"))}
FUSED_EXPERTS = {("mlp", "w_gate_EDF"): Source("mlp.experts.gate_up_proj", "gate"),
          ("mlp", "w_up_EDF"): Source("mlp.experts.gate_up_proj", "up"),
          ("mlp", "w_down_EFD"): Source("mlp.experts.down_proj", "down")}
SHARED_EXPERT = {("mlp", "shared_gate_DF"): Source("mlp.shared_expert.gate_proj.weight", "T"),
           ("mlp", "shared_up_DF"): Source("mlp.shared_expert.up_proj.weight", "T"),
           ("mlp", "shared_down_FD"): Source("mlp.shared_expert.down_proj.weight", "T"),
           ("mlp", "shared_gate_D1"): Source("mlp.shared_expert_gate.weight", "T")}
_TOP = {("embed_VD",): Source("model.embed_tokens.weight", "copy"),
        ("norm", "weight"): Source("model.norm.weight", "copy"), ("lm_head_DV",): Source("lm_head.weight", "T")}


def layer_sources(config, layer, fused=False):
  """{our path inside one DecoderLayer: Source with the full Hugging Face key} for `layer`."""
  table = dict(_ATTENTION)
  if config.attention_bias:
    table.update(_BIASES)
  if config.qk_norm:
    table.update(_QK_NORM)
  if config.is_sparse(layer):
    table.update(ROUTER)
    table.update(FUSED_EXPERTS if fused else PER_EXPERT)
    if config.shared_expert_intermediate_size:
      table.update(SHARED_EXPERT)
  else:
    table.update(_DENSE)
  return {path: dataclasses.replace(s, key=f"model.layers.{layer}.{s.key}") for path, s in table.items()}


def hf_shapes(source, shape, num_experts):
  """{Hugging Face key: its shape} of `source` for our per-layer array of shape `shape`."""
  if source.how == "copy":
    return {source.key: tuple(shape)}
  if source.how == "T":
    return {source.key: tuple(shape[::-1])}
  if source.how == "experts":
    return {source.key.format(e=e): (shape[2], shape[1]) for e in range(num_experts)}
  if source.how == "conv":
    return {source.key: (shape[0], 1, shape[1])}
  if source.how in ("gate", "up"):
    return {source.key: (shape[0], 2 * shape[2], shape[1])}
  return {source.key: (shape[0], shape[2], shape[1])}  # down


@dataclasses.dataclass(frozen=True)
class Param:
  """One of our parameters: per layer (`layers`, empty for top-level ones) the Source of its per-layer array."""
  sources: tuple  # one Source per layer (stacked) or a single one
  stacked: bool


def _layer_of_path(config, runtime, path):
  """(layers, path inside the layer, stacked) of one of our parameter paths, or (None, path, False) at top level."""
  if path[0] != "layers":
    return None, path, False
  groups = layer_groups(config, runtime)
  first, count, _ = groups[path[1]]
  if path[2] == qwen3.STACKED:
    return list(range(first, first + count)), path[3:], True
  return [first], path[2:], False


def param_sources(config, runtime, paths, fused_layers=frozenset()):
  """{our parameter path: Param} for every path in `paths` (tuples of keys from the pure dict of a model of
  `config` laid out as `runtime` says)."""
  out = {}
  for path in paths:
    layers, inner, stacked = _layer_of_path(config, runtime, path)
    if layers is None:
      out[path] = Param((_TOP[inner],), False)
      continue
    sources = tuple(layer_sources(config, layer, layer in fused_layers)[inner] for layer in layers)
    out[path] = Param(sources, stacked)
  return out


def param_paths(tree):
  """{path as a tuple of keys: leaf} of a pure-dict tree (`nnx.to_pure_dict`)."""
  return {tuple(getattr(k, "key", getattr(k, "idx", None)) for k in path): leaf
          for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}
