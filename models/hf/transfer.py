"""Hugging Face checkpoints of every model family (`models.families`: Qwen3-MoE `qwen3_moe`, Qwen2-MoE `qwen2_moe`,
Qwen3.5-MoE `qwen3_5_moe_text` and the multimodal `qwen3_5_moe`'s text model): import and export of the tensors
(`config.json` and which tensor each parameter comes from: each family's `hf_config` and `hf_names`; reading
safetensors: `models.hf.safetensors_io`).

Import reads a local directory (`config.json` and `*.safetensors`, with or without `model.safetensors.index.json`)
straight into the sharded layout: the model is built abstractly (`nnx.eval_shape`) for every parameter's shape and
`NamedSharding`, and each parameter is filled device by device (as `jax.make_array_from_callback` does, but
placing each slice before reading the next) with only the slice that device holds, read from the safetensors files
(transposed, and stacked over experts and layers, as needed). Host memory stays near one such slice; the whole
checkpoint is never in memory.

Both expert layouts are read: per expert (`mlp.experts.J.{gate,up,down}_proj.weight`, [out, in], what
`save_pretrained` writes) and fused (`mlp.experts.gate_up_proj` [E, 2F, D] with the gate rows first,
`mlp.experts.down_proj` [E, D, F], what recent transformers holds in memory). Export writes the per-expert layout.
"""

import json
import logging
import os
import pathlib

import jax
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from models import families
from models.qwen3.hf_names import hf_shapes, param_paths
from models.runtime import RuntimeConfig
from models.router_state import BIAS
from models.hf.safetensors_io import INDEX_FILE, SINGLE_FILE, Checkpoint, export_files
from relaymoe_jax.errors import UserError

MAX_SHARD_BYTES = 5 * 2 ** 30  # to_hf's default largest safetensors file

# ----------------------------------------------------------------------------------------------------------------
# Reading safetensors

def _normalize(index, shape):
  return tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape))


def read_source(checkpoint, source, index, shape):
  """Our per-layer array of shape `shape`, sliced by `index` (normalized slices), from `checkpoint`."""
  how = source.how
  if how == "copy":
    return checkpoint.read(source.key, index)
  if how == "T":
    return checkpoint.read(source.key, index[::-1]).T
  if how == "experts":
    e_slice, a, b = index
    parts = [checkpoint.read(source.key.format(e=e), (b, a)).T for e in range(e_slice.start, e_slice.stop)]
    return np.stack(parts) if parts else np.zeros((0, a.stop - a.start, b.stop - b.start), np.float32)
  if how == "conv":  # [C, 1, W] there
    c, w = index
    return checkpoint.read(source.key, (c, slice(0, 1), w))[:, 0, :]
  if how in ("gate", "up"):
    e, d, f = index
    offset = 0 if how == "gate" else shape[2]
    return checkpoint.read(source.key, (e, slice(f.start + offset, f.stop + offset), d)).transpose(0, 2, 1)
  e, f, d = index  # down
  return checkpoint.read(source.key, (e, d, f)).transpose(0, 2, 1)


def abstract_state(config, mesh, runtime):
  """(graphdef, abstract state, {path: ShapeDtypeStruct with its sharding}) of the model, nothing allocated."""
  graphdef, state = families.abstract(config, mesh, runtime=runtime)
  return graphdef, state, param_paths(nnx.to_pure_dict(state))


# ----------------------------------------------------------------------------------------------------------------
# Import


def _fused_layers(config, checkpoint, prefix):
  return frozenset(layer for layer in range(config.num_hidden_layers)
                   if f"{prefix}layers.{layer}.mlp.experts.gate_up_proj" in checkpoint.entries)


def _check_tensors(config, checkpoint, params, shapes, left_out=()):
  """Every tensor the model needs is there with its shape, and no other: else a ValueError naming the key."""
  expected = {}
  for path, param in params.items():
    per_layer = shapes[path].shape[1:] if param.stacked else shapes[path].shape
    for source in param.sources:
      expected.update(hf_shapes(source, per_layer, config.num_experts))
  missing = sorted(set(expected) - set(checkpoint.entries))
  if missing:
    raise UserError(f"tensor {missing[0]!r} is missing from the checkpoint ({len(missing)} missing: "
                    f"{missing[:5]}{' ...' if len(missing) > 5 else ''})")
  # A tied model's checkpoint may still hold lm_head.weight (a copy of the embeddings): transformers ignores it too.
  ignored = {"lm_head.weight"} if config.tie_word_embeddings else set()
  not_read = sorted({prefix for key in checkpoint.entries for prefix in left_out if key.startswith(prefix)})
  if not_read:
    logging.getLogger(__name__).warning("left out of the text model (transformers leaves them out too): %s",
                                        ", ".join(f"{p}* ({sum(k.startswith(p) for k in checkpoint.entries)} tensors)"
                                                  for p in not_read))
  ignored |= {key for key in checkpoint.entries if key.startswith(tuple(left_out))}
  unexpected = sorted(set(checkpoint.entries) - set(expected) - ignored)
  if unexpected:
    raise UserError(f"unexpected tensor {checkpoint.where(unexpected[0])} for this config "
                    f"({len(unexpected)} unexpected: {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''})")
  for key, shape in expected.items():
    if checkpoint.entries[key].shape != shape:
      raise UserError(f"tensor {checkpoint.where(key)} has shape {list(checkpoint.entries[key].shape)}; "
                      f"the config needs {list(shape)}")


def _reader(checkpoint, param, shape, dtype):
  """Reads the slice `index` of one parameter (global `shape`) in `dtype`, layer by layer when stacked."""

  def read(index):
    index = _normalize(index, shape)
    if not param.stacked:
      return np.ascontiguousarray(read_source(checkpoint, param.sources[0], index, shape), dtype=dtype)
    layers = index[0]
    out = np.empty((layers.stop - layers.start,) + tuple(s.stop - s.start for s in index[1:]), dtype)
    for j, layer in enumerate(range(layers.start, layers.stop)):
      out[j] = read_source(checkpoint, param.sources[layer], index[1:], shape[1:])
    return out

  return read


def _make_array(shape, sharding, read):
  """The global array whose device slices `read(index)` gives, like `jax.make_array_from_callback`, which holds
  every local device's slice in host memory before placing any: here each slice goes to its device before the next
  is read, so host memory stays near one device's slice. A replica is copied from the device already holding it."""
  arrays, placed = [], {}
  for device, index in sharding.addressable_devices_indices_map(shape).items():
    key = tuple((s.start, s.stop) for s in _normalize(index, shape))
    arrays.append(jax.device_put(placed[key] if key in placed else read(index), device))
    placed.setdefault(key, arrays[-1])
  return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


def load_params(config, mesh, hf_dir, device_by_device=True, *, runtime=RuntimeConfig()):
  """(graphdef, state) of the model (`config`, run as `runtime`) with every parameter read from `hf_dir` straight
  into its sharding (`device_by_device=False`: through `jax.make_array_from_callback`, for comparison)."""
  checkpoint = Checkpoint(hf_dir)
  graphdef, state, shapes = abstract_state(config, mesh, runtime)
  # Qwen3-MoE and Qwen2-MoE have no router bias: loss-free balancing's starts at zero.
  arrays = {p: jax.numpy.zeros(s.shape, s.dtype, device=s.sharding) for p, s in shapes.items() if p[-1] == BIAS}
  prefix, left_out = families.text_prefix(hf_dir)
  params = families.param_sources(config, runtime, {p: s for p, s in shapes.items() if p not in arrays}, prefix,
                                  _fused_layers(config, checkpoint, prefix))
  _check_tensors(config, checkpoint, params, shapes, left_out)
  for path, param in params.items():
    shape = shapes[path]
    read = _reader(checkpoint, param, shape.shape, np.dtype(shape.dtype))
    make = _make_array if device_by_device else jax.make_array_from_callback
    arrays[path] = make(shape.shape, shape.sharding, read)
  nnx.replace_by_pure_dict(state, _nest(arrays))
  return graphdef, state


def _nest(flat):
  out = {}
  for path, value in flat.items():
    node = out
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = value
  return out


def from_hf(hf_dir, *, mesh, runtime=RuntimeConfig(), **config_overrides):
  """The model of a local Hugging Face checkpoint directory, each parameter read straight into its sharding.

  Args:
    hf_dir: `config.json` and `*.safetensors` (one file, or shards with `model.safetensors.index.json`), experts
      per expert or fused; float32, float16 or bfloat16 tensors, cast to the config's param_dtype.
    mesh: the device mesh (an 'expert' axis; 'data' and 'tensor' if it has them).
    runtime: how the model runs (`RuntimeConfig`: dispatcher, compute dtype, layer scan, ...).
    **config_overrides: the family config's fields over those of `config.json` (see `families.config_from_hf`).

  Raises:
    ValueError: a missing or unexpected tensor, or one of the wrong shape (its key and file named); see also
      `config_from_hf`.
  """
  config = families.config_from_hf(hf_dir, **config_overrides)
  graphdef, state = load_params(config, mesh, hf_dir, runtime=runtime)
  return nnx.merge(graphdef, state)


# ----------------------------------------------------------------------------------------------------------------
# Export


def hf_tensors(source, array):
  """{Hugging Face key: tensor} of our per-layer `array` (per-expert layout)."""
  if source.how == "copy":
    return {source.key: np.ascontiguousarray(array)}
  if source.how == "T":
    return {source.key: np.ascontiguousarray(array.T)}
  if source.how == "experts":
    return {source.key.format(e=e): np.ascontiguousarray(array[e].T) for e in range(array.shape[0])}
  if source.how == "conv":
    return {source.key: np.ascontiguousarray(array[:, None, :])}
  raise ValueError(f"export writes the per-expert layout, not {source.how!r}")


def _layers_of(param, array):
  """(Source, host array of one layer) for each layer of one parameter, gathered one layer at a time."""
  if not param.stacked:
    yield param.sources[0], np.asarray(jax.device_get(array))
    return
  for j, source in enumerate(param.sources):
    yield source, np.asarray(jax.device_get(array[j]))


class _ShardWriter:
  """Collects tensors into files of at most `max_bytes` (a larger tensor gets a file alone), named at the end."""

  def __init__(self, out_dir, max_bytes):
    self.out_dir, self.max_bytes = out_dir, max_bytes
    self.pending, self.pending_bytes, self.parts, self.weight_map, self.total = {}, 0, [], {}, 0

  def add(self, key, tensor):
    if self.pending and self.pending_bytes + tensor.nbytes > self.max_bytes:
      self.flush()
    self.pending[key] = tensor
    self.pending_bytes += tensor.nbytes
    self.total += tensor.nbytes

  def flush(self):
    if not self.pending:
      return
    part = self.out_dir / f".part-{len(self.parts)}.safetensors"
    save_file(self.pending, part, metadata={"format": "pt"})
    self.parts.append((part, list(self.pending)))
    self.pending, self.pending_bytes = {}, 0

  def finish(self):
    self.flush()
    if len(self.parts) == 1:
      os.replace(self.parts[0][0], self.out_dir / SINGLE_FILE)
      return [SINGLE_FILE]
    names = [f"model-{i + 1:05d}-of-{len(self.parts):05d}.safetensors" for i in range(len(self.parts))]
    for (part, keys), name in zip(self.parts, names):
      os.replace(part, self.out_dir / name)
      self.weight_map.update({k: name for k in keys})
    index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(self.weight_map.items()))}
    (self.out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return names


def to_hf(model, out_dir, *, max_shard_bytes=MAX_SHARD_BYTES, dtype=None, overwrite=False):
  """Writes `model` as a Hugging Face checkpoint that `AutoModelForCausalLM.from_pretrained` loads.

  `config.json` (qwen3_moe or qwen2_moe, as the config implies: `config_to_hf`) and `model.safetensors`, or
  several files of at most `max_shard_bytes` each plus `model.safetensors.index.json`, experts per expert, in
  `dtype` ("bfloat16", "float16", "float32"; default the param dtype). Parameters are gathered to the host one at
  a time (stacked ones one layer at a time); process 0 writes. An earlier export in `out_dir` is refused, or with
  `overwrite` its files (and only those: `check_export_target`) are removed first.

  Returns:
    the names of the safetensors files written.
  """
  config = model.config
  out_dtype = np.dtype(jax.numpy.dtype(dtype or config.param_dtype))
  if out_dtype.name not in ("float32", "float16", "bfloat16"):
    raise UserError(f"to_hf: dtype={dtype!r} must be bfloat16, float16 or float32")
  hf_config = dict(families.config_to_hf(config), torch_dtype=out_dtype.name, dtype=out_dtype.name)
  flat = param_paths(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
  if config.router_bias_update_rate:
    logging.getLogger(__name__).warning(
        "to_hf: the router bias of auxiliary-loss-free balancing is not exported: %s has no field for it (DeepSeek-V3's"
        " e_score_correction_bias is one); transformers will route without it", hf_config["model_type"])
  params = families.param_sources(config, model.runtime, flat)
  out_dir = pathlib.Path(out_dir)
  stale = check_export_target(out_dir, overwrite)
  writer = _ShardWriter(out_dir, max_shard_bytes) if jax.process_index() == 0 else None
  if writer:
    out_dir.mkdir(parents=True, exist_ok=True)
    for file in stale:  # else a reader could take an old index's shards for the new export
      file.unlink()
  for path, param in params.items():
    for source, array in _layers_of(param, flat[path]):
      for key, tensor in hf_tensors(source, array).items():
        if writer:
          writer.add(key, tensor.astype(out_dtype, copy=False))
  if not writer:
    return []
  (out_dir / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
  return writer.finish()


def check_export_target(out_dir, overwrite):
  """The files of an earlier export in `out_dir` (to remove when `overwrite`); refused without it."""
  stale = export_files(out_dir)
  if stale and not overwrite:
    names = ", ".join(f.name for f in stale[:3]) + (f" and {len(stale) - 3} more" if len(stale) > 3 else "")
    raise UserError(f"{out_dir} holds an earlier export ({names}): choose another directory or overwrite it "
                    "(relaymoe-convert orbax-to-hf --overwrite; to_hf(overwrite=True))")
  return stale
