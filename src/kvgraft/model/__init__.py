"""kvgraft's model runtime: config, transformer, RoPE, the KV cache owner, generation."""

from kvgraft.model.cache import KVCache
from kvgraft.model.config import ModelConfig, RopeConfig
from kvgraft.model.generate import generate
from kvgraft.model.transformer import Transformer

__all__ = ["KVCache", "ModelConfig", "RopeConfig", "Transformer", "generate"]
