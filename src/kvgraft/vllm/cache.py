"""The CED's caches as vLLM cache layers: one module per storage kind, with its own spec and a tiny backend.

vLLM allocates, frees and tables the blocks; kvgraft's code reads and writes them (``kvgraft.vllm.context``).
Every module here is an ``AttentionLayerBase`` registered under its own name in vLLM's static forward
context, so the model runner collects its spec, binds its cache tensor and builds its metadata; none of
them computes attention (the backend has no kernel: the metadata is vLLM's block table and slot mapping).

- ``model.layers.{l}.self_attn.window_cache``: every layer; ``SlidingWindowSpec`` of W with one row per
  token (``[k ; v]`` of all K heads, kvgraft's ring row), so vLLM frees blocks as they leave the window;
- ``model.layers.{S}.self_attn.stream_cache``: kv_source layers only; ``FullAttentionSpec`` with
  ``tokens_per_state = m``, one pooled entry per m tokens;
- ``model.layers.{S}.self_attn.pending_cache``: kv_source layers, m > 1; ``SlidingWindowSpec`` of m with
  one ``[entry ; gate scores]`` row per token (the tokens of the block being filled).

Reading layers register nothing for the shared stream: they read their source's ``stream_cache``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

try:
    from vllm.config import VllmConfig, get_current_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.v1.attention.backend import (
        AttentionBackend,
        AttentionCGSupport,
        AttentionImpl,
        AttentionMetadataBuilder,
        CommonAttentionMetadata,
    )
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
except ImportError as exc:  # the optional extra is missing
    from kvgraft.vllm import EXTRA_HINT

    raise ImportError(EXTRA_HINT) from exc

from kvgraft.vllm.batched import BatchIndex, build_indices, plan_tiles
from kvgraft.vllm.geometry import PENDING, STREAM, WINDOW, PageGeometry

BACKEND_NAME = "KVGRAFT_CED_CACHE"


@dataclass
class CEDCacheMetadata:
    """One cache group's step: its block table and slot mapping, and where each request's tokens are."""

    block_table: torch.Tensor  # (requests, blocks) block ids of this group
    slot_mapping: torch.Tensor  # (tokens,) slot of each scheduled token in this group (-1: padding)
    query_start: list[int]  # requests + 1: token offsets of each request on the packed axis
    seq_lens: list[int]  # per request: tokens in the sequence once this step is done
    block_size: int  # tokens per block of this group
    batch: BatchIndex | None = None  # the batched path's indices (``kvgraft.vllm.batched``), when it is on


class CEDCacheBuilder(AttentionMetadataBuilder):
    _cudagraph_support: ClassVar[Any] = AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        context = vllm_config.compilation_config.static_forward_context
        layer = context.get(layer_names[0]) if layer_names else None
        self.cache_layer = layer if isinstance(layer, CEDCacheLayer) else None

    def build(self, common_prefix_len: int, common_attn_metadata: Any, fast_build: bool = False) -> CEDCacheMetadata:
        c: CommonAttentionMetadata = common_attn_metadata
        n = c.num_reqs
        query_start = c.query_start_loc_cpu[: n + 1]
        seq_lens = c.seq_lens[:n].cpu()
        block_size = int(self.kv_cache_spec.block_size)
        batch = None
        layer = self.cache_layer
        if layer is not None and layer.batched:
            g = layer.geometry
            tiles = plan_tiles(query_start.numpy(), seq_lens.numpy())
            batch = build_indices(
                layer.kind, tiles, c.block_table_tensor[:n], c.slot_mapping, block_size, g.window, g.compress_rate
            )
        return CEDCacheMetadata(
            block_table=c.block_table_tensor[:n],
            slot_mapping=c.slot_mapping[: c.num_actual_tokens],
            query_start=[int(v) for v in query_start.tolist()],
            seq_lens=[int(v) for v in seq_lens.tolist()],
            block_size=block_size,
            batch=batch,
        )


class CEDCacheImpl(AttentionImpl):
    """No attention kernel: kvgraft's own code attends (the layer's ``impl`` is only what vLLM expects)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise NotImplementedError("kvgraft's CED cache layers hold storage only; kvgraft.vllm.context attends")


class CEDCacheBackend(AttentionBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "float16", "bfloat16", "float32"]
    forward_includes_kv_cache_update = False

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type[CEDCacheImpl]:
        return CEDCacheImpl

    @staticmethod
    def get_builder_cls() -> type[CEDCacheBuilder]:
        return CEDCacheBuilder

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []


def cache_spec(kind: str, geometry: PageGeometry, dtype: torch.dtype) -> Any:
    """The vLLM spec of one cache kind (``window_cache``, ``stream_cache``, ``pending_cache``): one row
    per token or entry, as one "head" with no separate value, every block exactly ``page_bytes``."""
    g = geometry
    pad = g.page_bytes
    if kind == WINDOW:
        return SlidingWindowSpec(
            block_size=g.window_block,
            num_kv_heads=1,
            head_size=g.window_width,
            head_size_v=0,
            dtype=dtype,
            sliding_window=g.window,
        )
    if kind == STREAM:
        unpadded = g.stream_entries * g.entry_width * g.itemsize
        return FullAttentionSpec(
            block_size=g.stream_block,
            num_kv_heads=1,
            head_size=g.entry_width,
            head_size_v=0,
            dtype=dtype,
            tokens_per_state=g.compress_rate,
            page_size_padded=pad if pad != unpadded else None,
        )
    if kind == PENDING:
        unpadded = g.pending_block * g.pending_width * g.itemsize
        return SlidingWindowSpec(
            block_size=g.pending_block,
            num_kv_heads=1,
            head_size=g.pending_width,
            head_size_v=0,
            dtype=dtype,
            sliding_window=g.compress_rate,
            page_size_padded=pad if pad != unpadded else None,
        )
    raise ValueError(f"unknown CED cache kind {kind!r}; expected one of {WINDOW}, {STREAM}, {PENDING}")


class CEDCacheLayer(nn.Module, AttentionLayerBase):
    """One CED cache of one layer, as vLLM sees it: a spec, a bound cache tensor, a metadata builder.

    A window cache also carries ``attend``, the model's attention for its layer (set by the model), which the
    ``kvgraft_ced_attention`` op calls after finding the layer by name in vLLM's forward context."""

    attend: Callable[..., None]

    def __init__(self, kind: str, geometry: PageGeometry, dtype: torch.dtype, prefix: str) -> None:
        super().__init__()
        self.kind, self.geometry, self.dtype, self.layer_name = kind, geometry, dtype, prefix
        self.batched = False  # whether the builder also computes the batched path's indices (set by the model)
        self.spec = cache_spec(kind, geometry, dtype)
        self.impl = CEDCacheImpl()
        self.kv_cache = torch.tensor([])
        context = get_current_vllm_config().compilation_config.static_forward_context
        if prefix in context:
            raise ValueError(f"duplicate vLLM layer name {prefix!r}")
        context[prefix] = self

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        # vLLM's view is (blocks, heads = 1, rows per block, width); padded pages make it strided
        self.kv_cache = kv_cache

    def rows(self) -> torch.Tensor:
        """The bound cache as (blocks, rows per block, width)."""
        return self.kv_cache[:, 0]

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec:
        return self.spec

    def get_attn_backend(self) -> type[CEDCacheBackend]:
        return CEDCacheBackend
