"""Reading safetensors files slice by slice: the tensors of a directory (one file, or shards named by
`model.safetensors.index.json`) by key, each read as the NumPy slice asked for (bfloat16 included), nothing kept
open and no file read whole."""

import dataclasses
import json
import pathlib

import ml_dtypes
import numpy as np
from safetensors import safe_open

from relaymoe_jax.errors import UserError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Weights are floating point: an integer or bool tensor (a quantised or mislabelled checkpoint) is refused, never
# cast to float weights.
_SAFETENSORS_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}




@dataclasses.dataclass(frozen=True)
class _Entry:
  file: pathlib.Path
  dtype: str
  shape: tuple
  begin: int  # absolute byte offset of the tensor's data in `file`


class Checkpoint:
  """The tensors of a directory of safetensors files, by key, read slice by slice (nothing is kept open)."""

  def __init__(self, hf_dir):
    hf_dir = pathlib.Path(hf_dir)
    index = hf_dir / INDEX_FILE
    if index.exists():
      weight_map = json.loads(index.read_text())["weight_map"]
      files = sorted({hf_dir / f for f in weight_map.values()})
      absent = [str(f) for f in files if not f.exists()]
      if absent:
        raise UserError(f"{index} names file(s) that do not exist: {absent}")
      if (hf_dir / SINGLE_FILE).exists() and SINGLE_FILE not in weight_map.values():
        raise UserError(f"{hf_dir} holds {INDEX_FILE} and a {SINGLE_FILE} that it does not name: two exports "
                        f"mixed (transformers reads {SINGLE_FILE}, the index other files); remove the stale one")
    else:
      files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
      raise UserError(f"{hf_dir}: no *.safetensors files")
    self.entries = {}
    for file in files:
      for key, entry in _read_header(file).items():
        if key in self.entries:
          raise UserError(f"tensor {key!r} is in both {self.entries[key].file} and {file}")
        self.entries[key] = entry

  def where(self, key):
    return f"{key!r} (in {self.entries[key].file.name})"

  def read(self, key, index):
    """tensor `key`[index] as a NumPy array; `index` a tuple of step-1 slices, one per axis."""
    entry = self.entries[key]
    if entry.dtype == "BF16":  # NumPy has no bfloat16, so safetensors' NumPy reader refuses it: read the bytes
      return _read_raw(entry, index)
    if entry.dtype not in _SAFETENSORS_DTYPES:
      raise UserError(f"tensor {self.where(key)} has dtype {entry.dtype}; weights are read from floating point "
                      f"tensors only ({', '.join(_SAFETENSORS_DTYPES)})")
    with safe_open(entry.file, framework="numpy") as f:
      return f.get_slice(key)[index]


def export_files(directory):
  """The files in `directory` that an export (`models.hf.transfer.to_hf`) writes: what an earlier export left there."""
  directory = pathlib.Path(directory)
  named = [directory / n for n in ("config.json", SINGLE_FILE, INDEX_FILE) if (directory / n).exists()]
  return sorted(named + [*directory.glob("model-*-of-*.safetensors"), *directory.glob(".part-*.safetensors")])


def _read_header(file):
  """The entries of a safetensors file's header; a file cut short (a copy or download that stopped) is named."""
  with open(file, "rb") as f:
    size = int.from_bytes(f.read(8), "little")
    try:
      header = json.loads(f.read(size))
      header.pop("__metadata__", None)
      entries = {key: _Entry(file, h["dtype"], tuple(h["shape"]), 8 + size + h["data_offsets"][0])
                 for key, h in header.items()}
      end = 8 + size + max((h["data_offsets"][1] for h in header.values()), default=0)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
      raise UserError(f"{file} is not a safetensors file (its header does not read): cut short?") from None
  if file.stat().st_size < end:
    raise UserError(f"{file} is cut short: {file.stat().st_size} bytes, its header needs {end}")
  return entries


def _read_raw(entry, index):
  """Reads the rows of index[0] (contiguous bytes), then takes the rest of the index in memory."""
  dtype = np.dtype(_SAFETENSORS_DTYPES[entry.dtype])
  if not entry.shape:
    index = ()
  rows = index[0] if index else slice(0, 1)
  row_items = int(np.prod(entry.shape[1:], dtype=np.int64))
  with open(entry.file, "rb") as f:
    f.seek(entry.begin + rows.start * row_items * dtype.itemsize)
    data = f.read((rows.stop - rows.start) * row_items * dtype.itemsize)
  array = np.frombuffer(data, dtype).reshape((rows.stop - rows.start,) + entry.shape[1:])
  return array[(slice(None),) + tuple(index[1:])] if entry.shape else array.reshape(())
