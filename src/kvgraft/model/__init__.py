"""kvgraft's model floor: config, transformer, RoPE, the paged KV cache owner (generation: ``kvgraft.runtime``)."""

from kvgraft.model.batch import BatchContext
from kvgraft.model.cache import PagedKVCache
from kvgraft.model.config import ModelConfig, RopeConfig
from kvgraft.model.transformer import Transformer

__all__ = ["BatchContext", "ModelConfig", "PagedKVCache", "RopeConfig", "Transformer"]
