"""The one owner of the KV cache.

A ``KVCache`` is allocated once per batch of sequences, contiguous and preallocated to ``max_len``
tokens. It holds one slot per distinct entry of ``config.kv_slots``; the first layer mapping to a
slot writes it, later layers mapping to the same slot read it (cross-layer sharing is just the map).
Every stored tensor keeps time on dim -2, so other attention kinds (a latent of shape (B, T, d_c))
fit the same owner.
"""

from __future__ import annotations

import torch

from kvgraft.model.config import ModelConfig


class KVCache:
    def __init__(
        self,
        config: ModelConfig,
        batch_size: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if batch_size <= 0 or max_len <= 0:
            raise ValueError(f"batch_size ({batch_size}) and max_len ({max_len}) must be positive")
        self.config = config
        self.batch_size = batch_size
        self.max_len = max_len
        self.length = 0  # tokens already committed, identical for every row
        self.slots: dict[int, tuple[torch.Tensor, ...]] = {}
        for layer, slot in enumerate(config.kv_slots):
            if slot not in self.slots:
                # GQA: keys, values (B, K, max_len, d); MLA: latent + RoPE key (B, 1, max_len, d_c + d_rope)
                self.slots[slot] = tuple(
                    torch.zeros((batch_size, heads, max_len, width), dtype=dtype, device=device)
                    for heads, width in config.cache_entry_shapes(layer)
                )

    # ---- per-layer access ---------------------------------------------------------------------
    def write(self, layer: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Store this step's entries (time on dim -2) for a writing layer; return views up to the new end."""
        if not self.config.is_kv_writer(layer):
            raise RuntimeError(f"layer {layer} reads slot {self.config.kv_slots[layer]} and must not write it")
        stored = self.slots[self.config.kv_slots[layer]]
        t = tensors[0].shape[-2]
        end = self.length + t
        if end > self.max_len:
            raise ValueError(f"cache overflow: {end} tokens > max_len {self.max_len}; allocate a longer cache")
        for buf, x in zip(stored, tensors, strict=True):
            buf[..., self.length:end, :] = x
        return tuple(buf[..., :end, :] for buf in stored)

    def read(self, layer: int, new_tokens: int) -> tuple[torch.Tensor, ...]:
        """Views of a slot up to ``length + new_tokens`` (its writer ran earlier in this forward)."""
        end = self.length + new_tokens
        return tuple(buf[..., :end, :] for buf in self.slots[self.config.kv_slots[layer]])

    def advance(self, new_tokens: int) -> None:
        """Commit ``new_tokens`` after every layer ran; called once per forward by the model."""
        self.length += new_tokens

    def reset(self) -> None:
        self.length = 0

    # ---- accounting ---------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for slot in self.slots.values() for t in slot)

    def bytes_per_token(self) -> float:
        """Allocated bytes per token of context per sequence (measured from the live tensors)."""
        return self.nbytes / (self.batch_size * self.max_len)


class EphemeralKV:
    """Within-one-forward KV store for cache-less calls (training): writers hand their K/V to readers.

    Same ``write``/``read`` contract as ``KVCache`` but nothing is copied or kept after the forward.
    """

    def __init__(self, config: ModelConfig) -> None:
        self.config = config
        self.length = 0
        self.slots: dict[int, tuple[torch.Tensor, ...]] = {}

    def write(self, layer: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        self.slots[self.config.kv_slots[layer]] = tensors
        return tensors

    def read(self, layer: int, new_tokens: int) -> tuple[torch.Tensor, ...]:
        return self.slots[self.config.kv_slots[layer]]

    def advance(self, new_tokens: int) -> None:
        pass
