"""The one owner of a causal encoder-decoder's cache: shared compressed segments plus per-layer windows.

Per sequence it holds, preallocated for ``max_len`` tokens:
- one shared segment per kv_source layer: ``max_len // m`` pooled entries of d_c + d_rope values, and,
  with m > 1, the entries and gate scores of the (at most m - 1) tokens of the incomplete block;
- one ring buffer per layer of its last ``W`` tokens' window keys (d_nope + d_rope) and values (d_v),
  ``num_kv_heads`` heads each. Slot j holds the most recent position p with p % W == j.

``ModelConfig.ced_cache_values`` is the formula for its size (tested against the live tensors).
"""

from __future__ import annotations

import torch

from kvgraft.model.config import ModelConfig


class CEDCache:
    def __init__(
        self,
        config: ModelConfig,
        batch_size: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if not config.is_ced:
            raise ValueError("CEDCache needs a causal encoder-decoder config (kv_source_layers set)")
        if batch_size <= 0 or max_len <= 0:
            raise ValueError(f"batch_size ({batch_size}) and max_len ({max_len}) must be positive")
        self.config = config
        self.batch_size, self.max_len = batch_size, max_len
        self.length = 0  # tokens already committed, identical for every row
        self._step = 0  # tokens of the forward in progress
        m, D = config.compress_rate, config.kv_lora_rank + config.qk_rope_head_dim
        E = D + (config.index_head_dim if config.index_topk else 0)  # entry: latent, RoPE key (, index key)
        K, dk, dv = config.num_kv_heads, config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim
        self.ring_len = min(config.sliding_window, max_len)

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.segments = {s: zeros(batch_size, max_len // m, E) for s in config.kv_source_layers}
        self.pending = {s: (zeros(batch_size, m - 1, E), zeros(batch_size, m - 1, D))
                        for s in config.kv_source_layers} if m > 1 else {}
        self.windows = {layer: (zeros(batch_size, K, self.ring_len, dk), zeros(batch_size, K, self.ring_len, dv))
                        for layer in range(config.num_layers)}

    # ---- one forward step ------------------------------------------------------------------------
    def begin(self, new_tokens: int) -> None:
        """Called by the model before its layers run: checks room for ``new_tokens``."""
        end = self.length + new_tokens
        if end > self.max_len:
            raise ValueError(f"cache overflow: {end} tokens > max_len {self.max_len}; allocate a longer cache")
        self._step = new_tokens

    def compress(self, layer: int, compressor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Run kv_source ``layer``'s compressor on the new tokens, store every block they complete (and
        the remainder as pending), return the segment's entries so far (B, (length + T) // m, D)."""
        m, start = self.config.compress_rate, self.length
        entries = compressor.token_entries(x, cos, sin)
        segment = self.segments[layer]
        if m == 1:
            blocks = entries
        else:
            p = start % m
            pend_e, pend_s = self.pending[layer]
            all_e = torch.cat([pend_e[:, :p], entries], dim=1)
            all_s = torch.cat([pend_s[:, :p], compressor.gate_scores(x, start)], dim=1)
            n = all_e.shape[1] // m * m
            blocks = compressor.pool(all_e[:, :n], all_s[:, :n])
            pend_e[:, : all_e.shape[1] - n] = all_e[:, n:]
            pend_s[:, : all_e.shape[1] - n] = all_s[:, n:]
        first = start // m
        segment[:, first:first + blocks.shape[1]] = blocks
        return segment[:, : (start + self._step) // m]

    def shared(self, source: int) -> torch.Tensor:
        """The segment of kv_source layer ``source`` as of this step (its compressor already ran)."""
        return self.segments[source][:, : (self.length + self._step) // self.config.compress_rate]

    def window(self, layer: int, k: torch.Tensor, v: torch.Tensor, ring_only: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens' window keys/values in the ring and return the keys/values to attend:
        the ring itself for a one-token step (``ring_only``: the slot it overwrites held a token that has
        left the window), else [ring as it was ; new tokens]."""
        ring_k, ring_v = self.windows[layer]
        t = k.shape[2]
        if not ring_only:
            k_all, v_all = torch.cat([ring_k, k], dim=2), torch.cat([ring_v, v], dim=2)
        n = min(t, self.ring_len)
        if n == 1:
            slot = (self.length + t - 1) % self.config.sliding_window
            ring_k[:, :, slot:slot + 1] = k[:, :, t - 1:]
            ring_v[:, :, slot:slot + 1] = v[:, :, t - 1:]
        else:
            slots = torch.arange(self.length + t - n, self.length + t, device=k.device) % self.config.sliding_window
            ring_k[:, :, slots] = k[:, :, t - n:]
            ring_v[:, :, slots] = v[:, :, t - n:]
        return (ring_k, ring_v) if ring_only else (k_all, v_all)

    def advance(self, new_tokens: int) -> None:
        """Commit ``new_tokens`` after every layer ran; called once per forward by the model."""
        self.length += new_tokens
        self._step = 0

    def reset(self) -> None:
        self.length = 0
        self._step = 0

    # ---- accounting ------------------------------------------------------------------------------
    def tensors(self) -> list[torch.Tensor]:
        out = list(self.segments.values()) + [t for pair in self.pending.values() for t in pair]
        return out + [t for pair in self.windows.values() for t in pair]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def bytes_per_token(self) -> float:
        """Allocated bytes per token of context per sequence (measured from the live tensors)."""
        return self.nbytes / (self.batch_size * self.max_len)
