"""The one owner of the KV cache, for every attention kind: paged blocks plus per-sequence state.

Two kinds of storage, both preallocated once:

- **Paged pools** hold what grows with the context. Token positions are grouped into fixed-size blocks
  of ``block_size`` tokens; a sequence owns a *block table* (a list of block ids) and block ``b`` of
  every paged pool belongs to whoever holds ``b``. Pools: per KV-writing full-attention layer, one row
  per token (GQA: keys then values, ``2 K d`` values; MLA: the latent then the RoPE key,
  ``d_c + d_rope``); per kv_source layer of a causal encoder-decoder, its shared compressed segment,
  ``block_size / m`` pooled entries per block. Blocks are reference counted: two sequences may point at
  the same blocks (a fork, a shared prefix); whoever writes into a shared block first gets a private
  copy (copy on write), so sharing is never visible.
- **Per-sequence state** is what stays bounded whatever the context: every sliding-window layer keeps
  a *ring* of its last ``W`` tokens (Mistral-style windows and the encoder-decoder's per-layer windows;
  slot ``j`` holds the latest position ``p`` with ``p % W == j``), and each kv_source layer with m > 1
  keeps the entries and gate scores of the (at most m - 1) tokens of its incomplete block. A sequence
  takes one state slot; a fork copies it.

``cache_layout(config)`` is the one table of what each layer stores; ``ModelConfig.kv_cache_bytes``
and this class's allocation both derive from it (tested equal). Layers never touch the pools
directly: :class:`kvgraft.model.batch.BatchContext` hands them gathered views for one forward step.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import torch

from kvgraft.model.config import ModelConfig


class CacheFullError(RuntimeError):
    """Not enough free blocks or sequence slots; the engine preempts, direct callers allocate more."""


@dataclass(frozen=True)
class CacheLayout:
    """What every layer stores, per sequence. Widths are values per token (per entry for segments)."""

    paged: dict[int, int]  # full-attention KV-writing layer -> values per token
    rings: dict[int, int]  # sliding-window storing layer -> values per token (ring of ``window`` tokens)
    window: int | None  # ring length W (one window size per model)
    segments: dict[int, int]  # kv_source layer -> values per pooled entry (latent, RoPE key, index key)
    compress_rate: int  # m: tokens per pooled entry
    pending: dict[int, int]  # kv_source layer -> values per pending token (entry + gate scores), m > 1

    def values(self, context: int, ring_len: int | None = None) -> int:
        """Values one sequence holding ``context`` tokens stores (rings of ``ring_len``, default
        ``min(W, context)``; pooled entries for complete blocks only)."""
        if ring_len is None:
            ring_len = min(self.window, context) if self.window else 0
        total = sum(self.paged.values()) * context
        total += sum(self.segments.values()) * (context // self.compress_rate)
        total += sum(self.rings.values()) * ring_len
        total += sum(self.pending.values()) * (self.compress_rate - 1)
        return total


def cache_layout(config: ModelConfig) -> CacheLayout:
    """The one table of cache storage, derived from the config."""
    paged: dict[int, int] = {}
    rings: dict[int, int] = {}
    segments: dict[int, int] = {}
    pending: dict[int, int] = {}
    if config.is_ced:
        D = config.kv_lora_rank + config.qk_rope_head_dim
        E = D + (config.index_head_dim if config.index_topk else 0)
        K = config.num_kv_heads
        for layer in range(config.num_layers):
            rings[layer] = K * (config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim)
        for s in config.kv_source_layers:
            segments[s] = E
            if config.compress_rate > 1:
                pending[s] = E + D
        return CacheLayout(paged, rings, config.sliding_window, segments, config.compress_rate, pending)
    for layer in range(config.num_layers):
        if not config.is_kv_writer(layer):
            continue
        width = sum(h * w for h, w in config.cache_entry_shapes(layer))
        (rings if config.window(layer) is not None else paged)[layer] = width
    return CacheLayout(paged, rings, config.sliding_window if rings else None, segments, 1, pending)


@dataclass
class CacheSnapshot:
    """A sequence's cache frozen at ``length`` tokens: its blocks (held, reference counted) and a copy of
    its per-sequence state. :meth:`PagedKVCache.restore` starts new sequences from it, sharing the blocks;
    :meth:`PagedKVCache.release` lets the blocks go."""

    blocks: tuple[int, ...]
    length: int
    state: dict[tuple[str, int], torch.Tensor]  # ("ring" | "pending", layer) -> the slot's copy
    released: bool = False

    @property
    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state.values())


@dataclass
class _Sequence:
    slot: int  # state slot (rings, pending tokens)
    blocks: list[int] = field(default_factory=list)
    length: int = 0  # tokens committed


class PagedKVCache:
    """Paged pools + per-sequence state slots, with a block allocator and reference counts.

    ``num_blocks`` blocks of ``block_size`` tokens are shared by all sequences; ``max_seqs`` sequences
    can be live at once; ``max_seq_len`` bounds one sequence (and sizes the rings: ``min(W, max_seq_len)``).
    """

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int = 16,
        max_seqs: int = 64,
        max_seq_len: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size), ("max_seqs", max_seqs)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} ({value!r}) must be a positive integer")
        max_seq_len = num_blocks * block_size if max_seq_len is None else max_seq_len
        if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < 1:
            raise ValueError(f"max_seq_len ({max_seq_len!r}) must be a positive integer")
        self.layout = layout = cache_layout(config)
        m = layout.compress_rate
        if block_size % m:
            raise ValueError(f"block_size ({block_size}) must be a multiple of compress_rate ({m}): a block "
                             "holds whole pooled entries")
        self.config, self.block_size, self.num_blocks, self.max_seqs = config, block_size, num_blocks, max_seqs
        self.max_seq_len, self.dtype, self.device = max_seq_len, dtype, torch.device(device)
        self.ring_len = min(layout.window, max_seq_len) if layout.window else 0

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        # GQA layers store keys and values head-major, (2K, blocks, block_size, head_dim): gathering a batch's
        # blocks then yields each head's keys contiguous, which decode attention reads without another copy.
        # Other paged layers store one row per token, (blocks, block_size, width).
        self.head_major = {layer: (2 * config.num_kv_heads, config.head_dim) for layer in layout.paged
                           if config.attention_kinds[layer] == "gqa"}
        self.paged = {layer: zeros(self.head_major[layer][0], num_blocks, block_size, self.head_major[layer][1])
                      if layer in self.head_major else zeros(num_blocks, block_size, w)
                      for layer, w in layout.paged.items()}
        self.segments = {s: zeros(num_blocks, block_size // m, w) for s, w in layout.segments.items()}
        self.rings = {layer: zeros(max_seqs, self.ring_len, w) for layer, w in layout.rings.items()}
        self.pending = {s: zeros(max_seqs, m - 1, w) for s, w in layout.pending.items()}
        self._refcount = [0] * num_blocks
        self._multi = 0  # blocks held more than once
        self._free_blocks: deque[int] = deque(range(num_blocks))
        self._free_slots: deque[int] = deque(range(max_seqs))
        self._seqs: dict[int, _Sequence] = {}
        self._next_id = 0
        itemsize = torch.empty((), dtype=dtype).element_size()
        self.block_bytes = itemsize * (block_size * sum(layout.paged.values())
                                       + block_size // m * sum(layout.segments.values()))
        self.slot_bytes = itemsize * (self.ring_len * sum(layout.rings.values())
                                      + (m - 1) * sum(layout.pending.values()))

    # ---- sequences ---------------------------------------------------------------------------------
    def add_sequence(self) -> int:
        """A new empty sequence; its id. Raises CacheFullError when every state slot is taken."""
        if not self._free_slots:
            raise CacheFullError(f"all {self.max_seqs} sequence slots are in use")
        seq = self._next_id
        self._next_id += 1
        self._seqs[seq] = _Sequence(self._free_slots.popleft())
        self._clear_state(self._seqs[seq].slot)
        return seq

    def fork(self, seq: int) -> int:
        """A new sequence holding the same tokens: same blocks (reference counted, not copied), a copy of
        the per-sequence state. Later writes of either side copy a shared block first."""
        src = self._get(seq)
        child = self.add_sequence()
        c = self._seqs[child]
        c.blocks, c.length = list(src.blocks), src.length
        for b in src.blocks:
            self._incref(b)
        for pools in (self.rings, self.pending):
            for t in pools.values():
                t[c.slot] = t[src.slot]
        return child

    def snapshot(self, seq: int) -> CacheSnapshot:
        """Freeze ``seq`` as it is now: hold its blocks (the sequence may go on; its next write into a
        held block copies it first) and copy its per-sequence state."""
        s = self._get(seq)
        for b in s.blocks:
            self._incref(b)
        n = min(s.length, self.ring_len)  # ring slots written so far (all once the context reaches W)
        state = {("ring", layer): t[s.slot, :n].clone() for layer, t in self.rings.items()}
        state.update({("pending", layer): t[s.slot].clone() for layer, t in self.pending.items()})
        return CacheSnapshot(tuple(s.blocks), s.length, state)

    def restore(self, snap: CacheSnapshot) -> int:
        """A new sequence holding the snapshot's tokens: its blocks shared (reference counted), its state
        copied into the new sequence's slot. Raises CacheFullError when no slot is free."""
        if snap.released:
            raise ValueError("restore: the snapshot was released")
        seq = self.add_sequence()
        s = self._seqs[seq]
        s.blocks, s.length = list(snap.blocks), snap.length
        for b in snap.blocks:
            self._incref(b)
        for (kind, layer), t in snap.state.items():  # (a ring of a short context: its written slots)
            (self.rings if kind == "ring" else self.pending)[layer][s.slot, : t.shape[0]] = t
        return seq

    def release(self, snap: CacheSnapshot) -> None:
        """Let a snapshot's blocks go (freed when no sequence or other snapshot holds them)."""
        if snap.released:
            return
        for b in snap.blocks:
            self._release(b)
        snap.released = True

    def free(self, seq: int) -> None:
        """Release a sequence: its blocks (when no other sequence holds them) and its state slot."""
        s = self._seqs.pop(seq, None)
        if s is None:
            raise KeyError(f"unknown sequence {seq}")
        for b in s.blocks:
            self._release(b)
        self._free_slots.append(s.slot)

    def length(self, seq: int) -> int:
        return self._get(seq).length

    def block_table(self, seq: int) -> list[int]:
        return list(self._get(seq).blocks)

    def slot(self, seq: int) -> int:
        return self._get(seq).slot

    def refcount(self, block: int) -> int:
        return self._refcount[block]

    @property
    def sequences(self) -> list[int]:
        return list(self._seqs)

    # ---- allocation ------------------------------------------------------------------------------
    def blocks_needed(self, seq: int, new_tokens: int) -> int:
        """Free blocks that ``extend(seq, new_tokens)`` would take (new blocks plus copy on write)."""
        s = self._get(seq)
        end = s.length + new_tokens
        need = max(0, math.ceil(end / self.block_size) - len(s.blocks)) if self.block_bytes else 0
        first = s.length // self.block_size  # the block the next token lands in
        if new_tokens and first < len(s.blocks) and self._refcount[s.blocks[first]] > 1:
            need += 1
        return need

    def can_extend(self, seq: int, new_tokens: int) -> bool:
        return self._get(seq).length + new_tokens <= self.max_seq_len and \
            self.blocks_needed(seq, new_tokens) <= len(self._free_blocks)

    def extend(self, seq: int, new_tokens: int) -> None:
        """Make room for ``new_tokens`` more tokens: allocate blocks, copy a shared block before it is written."""
        s = self._get(seq)
        end = s.length + new_tokens
        if end > self.max_seq_len:
            raise ValueError(f"cache overflow: {end} tokens > max_seq_len {self.max_seq_len}; allocate a longer cache")
        if self.blocks_needed(seq, new_tokens) > len(self._free_blocks):
            raise CacheFullError(
                f"sequence {seq} needs {self.blocks_needed(seq, new_tokens)} more blocks for {new_tokens} tokens, "
                f"{len(self._free_blocks)} free of {self.num_blocks}")
        if not self.block_bytes:
            return
        first = s.length // self.block_size
        if new_tokens and first < len(s.blocks) and self._refcount[s.blocks[first]] > 1:
            old, new = s.blocks[first], self._allocate()
            for layer, t in self.paged.items():
                if layer in self.head_major:
                    t[:, new] = t[:, old]
                else:
                    t[new] = t[old]
            for t in self.segments.values():
                t[new] = t[old]
            self._release(old)
            s.blocks[first] = new
        while len(s.blocks) * self.block_size < end:
            s.blocks.append(self._allocate())

    def commit(self, seq: int, new_tokens: int) -> None:
        """Record ``new_tokens`` written (called once per forward, after every layer ran)."""
        self._get(seq).length += new_tokens

    # ---- accounting ------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes allocated for the pools and state slots (fixed at construction)."""
        pools = (self.paged, self.segments, self.rings, self.pending)
        return sum(t.numel() * t.element_size() for p in pools for t in p.values())

    @property
    def free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def free_blocks(self) -> int:
        return len(self._free_blocks)

    @property
    def used_bytes(self) -> int:
        """Bytes of blocks held by some sequence plus the state slots of live sequences."""
        return (self.num_blocks - len(self._free_blocks)) * self.block_bytes + len(self._seqs) * self.slot_bytes

    @property
    def shared_bytes(self) -> int:
        """Bytes of blocks held more than once (by several sequences or snapshots), each counted once."""
        return self._multi * self.block_bytes

    @property
    def free_bytes(self) -> int:
        return self.nbytes - self.used_bytes

    def needed_bytes(self) -> int:
        """Bytes the live sequences' tokens need without paging; each sequence counts its own tokens, so
        forked sequences that share blocks are counted once per sequence."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return sum(self.layout.values(s.length, self.ring_len) for s in self._seqs.values()) * itemsize

    def bytes_per_token(self) -> float:
        """Allocated bytes per token of context per sequence slot (a cache from ``Transformer.new_cache``)."""
        return self.nbytes / (self.max_seqs * self.max_seq_len)

    # ---- internals -------------------------------------------------------------------------------
    def _get(self, seq: int) -> _Sequence:
        try:
            return self._seqs[seq]
        except KeyError:
            raise KeyError(f"unknown sequence {seq}; live sequences: {sorted(self._seqs)}") from None

    def _allocate(self) -> int:
        b = self._free_blocks.popleft()
        self._refcount[b] = 1
        return b

    def _incref(self, b: int) -> None:
        if self._refcount[b] == 1:
            self._multi += 1
        self._refcount[b] += 1

    def _release(self, b: int) -> None:
        self._refcount[b] -= 1
        if self._refcount[b] == 1:
            self._multi -= 1
        if self._refcount[b] == 0:
            self._free_blocks.append(b)

    def _clear_state(self, slot: int) -> None:
        for pools in (self.rings, self.pending):
            for t in pools.values():
                t[slot].zero_()


def default_block_size(config: ModelConfig, tokens: int = 16) -> int:
    """``tokens`` rounded up to a multiple of the compression rate (a block holds whole pooled entries)."""
    m = config.compress_rate if config.is_ced else 1
    return math.ceil(tokens / m) * m


def static_cache(config: ModelConfig, batch_size: int, max_len: int, dtype: torch.dtype,
                 device: torch.device | str, block_size: int | None = None) -> tuple[PagedKVCache, list[int]]:
    """A cache sized for ``batch_size`` sequences of up to ``max_len`` tokens each, and those sequences.

    ``block_size`` defaults to :func:`default_block_size`."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size ({batch_size!r}) must be a positive integer")
    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
        raise ValueError(f"max_len ({max_len!r}) must be a positive integer")
    if block_size is None:
        block_size = default_block_size(config)
    per_seq = math.ceil(max_len / block_size)
    cache = PagedKVCache(config, num_blocks=batch_size * per_seq, block_size=block_size, max_seqs=batch_size,
                         max_seq_len=max_len, dtype=dtype, device=device)
    return cache, [cache.add_sequence() for _ in range(batch_size)]
