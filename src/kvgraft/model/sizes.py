"""What a paged cache of given arguments holds and costs, without building one: the block size a model
needs, its window rings' geometry, and the bytes of a token block and of the fixed part (what a memory
budget is divided by, ``kvgraft.runtime.budget``)."""

from __future__ import annotations

import math

import torch

from kvgraft.model.config import ModelConfig, cache_layout
from kvgraft.model.rings import ring_shape

__all__ = ["default_block_size", "pool_bytes", "ring_geometry"]


def ring_geometry(config: ModelConfig, block_size: int, max_seq_len: int) -> tuple[int, int, int]:
    """(ring length R = min(W, max_seq_len), ring block rb = gcd(R, block_size), ring blocks per sequence
    and group R / rb); zeros without window layers."""
    layout = cache_layout(config)
    return ring_shape(layout.window if layout.rings else None, block_size, max_seq_len)


def pool_bytes(
    config: ModelConfig,
    block_size: int,
    max_seqs: int,
    max_seq_len: int,
    dtype: torch.dtype,
    ring_blocks: int | None = None,
) -> tuple[int, int]:
    """(bytes of one token block over every paged pool and shared segment, bytes the cache allocates besides
    its token blocks: window rings and state slots), so that a :class:`PagedKVCache` with these arguments and
    ``num_blocks`` token blocks measures ``fixed + num_blocks * per_block`` bytes (``nbytes``; tested). What a
    memory budget is divided by (``kvgraft.runtime.budget``)."""
    layout = cache_layout(config)
    m = layout.compress_rate
    itemsize = torch.empty((), dtype=dtype).element_size()
    per_block = itemsize * (block_size * sum(layout.paged.values()) + block_size // m * sum(layout.segments.values()))
    _, rb, nrb = ring_shape(layout.window if layout.rings else None, block_size, max_seq_len)
    rings = (max_seqs * nrb if ring_blocks is None else ring_blocks) * rb * sum(layout.rings.values()) if nrb else 0
    pending = max_seqs * (m - 1) * sum(layout.pending.values())
    return per_block, itemsize * (rings + pending)


def default_block_size(config: ModelConfig, tokens: int = 16) -> int:
    """``tokens`` rounded up to a multiple of the compression rate (a block holds whole pooled entries)."""
    m = config.compress_rate if config.is_ced else 1
    return math.ceil(tokens / m) * m
