"""Hugging Face checkpoints in and out: `from_hf` / `to_hf` (`transfer`), over safetensors read slice by slice
(`safetensors_io`); each model family says which tensor each of its parameters comes from."""

from models.hf.transfer import from_hf, to_hf

__all__ = ["from_hf", "to_hf"]
