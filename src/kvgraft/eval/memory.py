"""KV-cache bytes per token: the config's formula checked against a cache actually allocated."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from kvgraft.checks import check_int
from kvgraft.model.transformer import Transformer

CONTEXTS: tuple[int, ...] = (1024, 4096, 8192, 32768)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class KVMemory:
    bytes_per_token_formula: float  # config.kv_cache_bytes(max_len, itemsize) / max_len: all layers, one sequence
    bytes_per_token_measured: float  # allocated cache nbytes / max_len at batch 1
    agree: bool  # formula * max_len == allocated nbytes
    dtype: str  # e.g. "bfloat16"
    per_context: dict[int, int] = field(default_factory=dict)  # context tokens -> bytes per sequence (formula)
    max_len: int = 0  # tokens of the cache that was allocated to measure

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ``per_context`` keys become strings (JSON object keys are strings)."""
        d = asdict(self)
        d["per_context"] = {str(k): v for k, v in self.per_context.items()}
        return d


def kv_memory(
    model: Transformer,
    dtype: torch.dtype = torch.bfloat16,
    max_len: int = 4096,
    contexts: tuple[int, ...] = CONTEXTS,
) -> KVMemory:
    """Cache bytes per token of context for one sequence, from the formula and from a real allocation.

    The formula is ``model.config.kv_cache_bytes(max_len, itemsize of dtype)`` (per token: divided by
    ``max_len``; constant for GQA/MLA, falling with context for a causal encoder-decoder, whose windows
    are a fixed cost); the measurement allocates
    ``model.new_cache(1, max_len, dtype)`` (on the model's device) and divides its ``nbytes`` by
    ``max_len``. ``agree`` reports whether they match exactly; a mismatch is reported, not raised.
    """
    check_int("max_len", max_len, low=1)
    itemsize = torch.empty((), dtype=dtype).element_size()
    formula = model.config.kv_cache_bytes(max_len, itemsize)
    cache = model.new_cache(1, max_len, dtype)
    nbytes = int(cache.nbytes)
    del cache
    return KVMemory(
        bytes_per_token_formula=formula / max_len,
        bytes_per_token_measured=nbytes / max_len,
        agree=nbytes == formula,
        dtype=dtype_name(dtype),
        per_context={int(c): model.config.kv_cache_bytes(int(c), itemsize) for c in contexts},
        max_len=max_len,
    )
