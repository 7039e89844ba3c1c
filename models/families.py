"""Model families by name: each one's architecture config, model, Hugging Face adapter and FLOP count. A model
YAML (or a checkpoint's config.json) names its family by `model_type`; Qwen3-MoE when it names none."""

import dataclasses
from types import ModuleType

from models.config import from_mapping, read_hf_config, read_yaml
from models.qwen3 import config as qwen3_config, hf_config as qwen3_hf, hf_names as qwen3_names, model as qwen3
from models.qwen35 import config as qwen35_config, hf_config as qwen35_hf, hf_names as qwen35_names, model as qwen35
from models.runtime import RUNTIME_FIELDS
from relaymoe_jax.errors import UserError


@dataclasses.dataclass(frozen=True)
class Family:
  name: str
  config_class: type
  model: ModuleType  # abstract(), create_sharded()
  hf_types: tuple  # the config.json model_types it reads
  spans: bool = False  # its layers run long rows in spans (`models.spans`, `runtime.sequence_span_tokens`)


QWEN3 = Family("qwen3_moe", qwen3_config.Qwen3MoEConfig, qwen3, tuple(qwen3_hf.FAMILIES))
QWEN35 = Family(qwen35_config.MODEL_TYPE, qwen35_config.Qwen35MoEConfig, qwen35, qwen35_hf.MODEL_TYPES,
                spans=True)
FAMILIES = (QWEN3, QWEN35)


def of(config) -> Family:
  """The family of an architecture config."""
  return next(f for f in FAMILIES if isinstance(config, f.config_class))


def config_from_mapping(data, where):
  """An architecture config from a mapping (a model YAML's): Qwen3.5 with `model_type: qwen3_5_moe_text`."""
  data = dict(data)
  runtime_keys = sorted(RUNTIME_FIELDS & set(data))
  if runtime_keys:
    raise UserError(f"{where}: {runtime_keys} say how the model runs, not what it is: set them as runtime.KEY (the "
                    "run config's `runtime` section or a `runtime.KEY=VALUE` override)")
  if data.get("model_type", QWEN3.name) == QWEN3.name:
    data.pop("model_type", None)
    return from_mapping(QWEN3.config_class, data, where)
  if data["model_type"] == QWEN35.name:
    return from_mapping(QWEN35.config_class, data, where)
  raise UserError(f"{where}: model_type {data['model_type']!r} unknown; known: {[f.name for f in FAMILIES]}")


def load_config(path_or_name, **overrides):
  """A model config from a YAML file or a name under configs/models/ (e.g. "qwen3-30b-a3b", "qwen3.5-35b-a3b")."""
  return config_from_mapping(dict(read_yaml(path_or_name, "models"), **overrides), f"model config {path_or_name}")


def config_from_hf(hf_dir, **overrides):
  """Our architecture config of a Hugging Face checkpoint directory, of whichever family its model_type names."""
  hf, path = read_hf_config(hf_dir)
  if hf.get("model_type") in QWEN35.hf_types:
    return qwen35_hf.config_from_hf(hf, path, **overrides)
  if hf.get("model_type") in QWEN3.hf_types:
    return qwen3_hf.config_from_hf(hf_dir, **overrides)
  known = sorted(t for f in FAMILIES for t in f.hf_types)
  raise UserError(f"{path}: model_type {hf.get('model_type')!r} is not supported; known: {known}")


def config_to_hf(config):
  return qwen35_hf.config_to_hf(config) if of(config) is QWEN35 else qwen3_hf.config_to_hf(config)


def text_prefix(hf_dir):
  """Where a checkpoint's text-model tensors are (`model.`; a Qwen3.5 multimodal one's `model.language_model.`),
  and the key prefixes of tensors the text model leaves out (`mtp.`, `model.visual.`)."""
  model_type = read_hf_config(hf_dir)[0].get("model_type")
  return qwen35_hf.TEXT_PREFIX.get(model_type, "model."), qwen35_hf.LEFT_OUT.get(model_type, ())


def param_sources(config, runtime, paths, prefix="model.", fused_layers=frozenset()):
  """{our parameter path: its Hugging Face tensors} (`models.qwen3.hf_names.Param`) for the family of `config`."""
  if of(config) is QWEN35:
    return qwen35_names.param_sources(config, runtime, paths, prefix, fused_layers)
  return qwen3_names.param_sources(config, runtime, paths, fused_layers)


def abstract(config, mesh, seed=0, *, runtime):
  return of(config).model.abstract(config, mesh, seed, runtime=runtime)


def create_sharded(config, mesh, seed=0, *, runtime):
  return of(config).model.create_sharded(config, mesh, seed, runtime=runtime)
