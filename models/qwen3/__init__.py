"""Qwen3-MoE and Qwen2-MoE: the architecture's config (`config`), the Flax NNX model (`model`) and which
Hugging Face tensor each parameter comes from (`hf_config`, `hf_names`)."""

from models.qwen3.config import Qwen3MoEConfig, load_config
from models.qwen3.model import Qwen3MoE

__all__ = ["Qwen3MoE", "Qwen3MoEConfig", "load_config"]
