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
- **Window rings** stay bounded whatever the context: every sliding-window layer keeps a *ring* of its
  last ``W`` tokens (Mistral-style windows and the encoder-decoder's per-layer windows; ring slot ``j``
  holds the latest position ``p`` with ``p % W == j``). Rings are paged too: a ring is ``W / rb`` *ring
  blocks* of ``rb = gcd(W, block_size)`` slots, held
  by reference count with copy on write like token blocks. The ring layers are split into **ring
  groups** that share one ring-block table per sequence: on a causal encoder-decoder, the layers before
  the pivot (the last kv_source layer: the *encoder*, whose windows a certified adapter never changes)
  and the layers from the pivot on (the *decoder*). Sequences started from one snapshot (N adapters over
  one prompt) reference the encoder's ring blocks and the shared segments, and hold only their own
  decoder rings (:meth:`PagedKVCache.restore` with ``recompute_from``); a step that writes into a shared
  ring block copies that block first (one ring block per group per decode step at most). The ring pools,
  ring groups and their allocators are :class:`kvgraft.model.rings.WindowRings`, which the cache owns.
- **Per-sequence state**: each kv_source layer with m > 1 keeps the entries and gate scores of the (at
  most m - 1) tokens of its incomplete block. A sequence takes one state slot; a fork copies it.

``cache_layout(config)`` is the one table of what each layer stores; ``ModelConfig.kv_cache_bytes``
and this class's allocation both derive from it (tested equal). Layers never touch the pools
directly: :class:`kvgraft.model.batch.BatchContext` hands them gathered views for one forward step.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from kvgraft.model.config import ModelConfig
from kvgraft.model.rings import WindowRings, ring_shape


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

    spans: tuple[tuple[int, tuple[int, ...]], ...]  # (first unit, block ids) per layer span (held)
    length: int
    state: dict[tuple[str, int], torch.Tensor]  # ("pending", layer) -> the slot's copy
    rings: tuple[tuple[int, ...], ...] = ()  # per ring group: ring-block ids (held), -1 = never written
    released: bool = False

    @property
    def blocks(self) -> tuple[int, ...]:
        """The block ids of the first layer span (all layers' when the snapshot has one span)."""
        return self.spans[0][1] if self.spans else ()

    @property
    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state.values())


@dataclass
class _Sequence:
    slot: int  # state slot (pending tokens)
    spans: list[list] = field(default_factory=lambda: [[0, []]])  # [first unit, block ids] per layer span
    length: int = 0  # tokens committed
    rings: list[list[int]] = field(default_factory=list)  # per ring group: ring-block ids, -1 = not allocated
    expect_blocks: int = 0  # blocks the sequence expects to fill (add_sequence(expect_tokens=)); 0: unknown


class PagedKVCache:
    """Paged pools + paged window rings + per-sequence state slots, with block allocators and reference counts.

    ``num_blocks`` token blocks of ``block_size`` tokens are shared by all sequences; ``max_seqs`` sequences
    can be live at once; ``max_seq_len`` bounds one sequence (and sizes the rings: ``min(W, max_seq_len)``).
    ``ring_blocks``: ring blocks per ring group (default: every live sequence's whole rings,
    ``max_seqs * ring_len / ring_block``, the memory of one ring per slot; more leaves room for snapshots
    that keep rings after their sequence moved on). ``ring_split``: the first layer of the second ring
    group (default: a causal encoder-decoder's pivot, the last kv_source layer; None: one group).
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
        ring_blocks: int | None = None,
        ring_split: int | None | str = "pivot",
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
        if ring_split == "pivot":
            ring_split = max(config.kv_source_layers) if config.is_ced and config.kv_source_layers else None
        # window rings: their pools, ring groups and allocators (a sequence keeps its ring-block tables)
        self.window_rings = wr = WindowRings(layout.rings, layout.window, block_size, max_seq_len, max_seqs, ring_blocks,
                                             ring_split, config.num_layers, config.is_ced, dtype, device)
        self.ring_len, self.ring_block, self.ring_blocks_per_seq = wr.ring_len, wr.ring_block, wr.blocks_per_seq
        self.ring_split, self.ring_groups, self.ring_group_of, self.rings = wr.split, wr.groups, wr.group_of, wr.pools

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        itemsize = torch.empty((), dtype=dtype).element_size()
        # GQA layers store keys and values head-major, (2K, blocks, block_size, head_dim): gathering a batch's
        # blocks then yields each head's keys contiguous, which decode attention reads without another copy.
        # Other paged layers store one row per token, (blocks, block_size, width).
        self.head_major = {layer: (2 * config.num_kv_heads, config.head_dim) for layer in layout.paged
                           if config.attention_kinds[layer] == "gqa"}
        self.paged = {layer: zeros(self.head_major[layer][0], num_blocks, block_size, self.head_major[layer][1])
                      if layer in self.head_major else zeros(num_blocks, block_size, w)
                      for layer, w in layout.paged.items()}
        self.segments = {s: zeros(num_blocks, block_size // m, w) for s, w in layout.segments.items()}
        self.pending = {s: zeros(max_seqs, m - 1, w) for s, w in layout.pending.items()}
        # token blocks: one id space, a reference count per (unit, block): a unit is a paged layer or a
        # segment; a sequence's layers share one block table except where a restore split them into spans
        self.units = [("paged", x) for x in sorted(layout.paged)] + [("segment", x) for x in sorted(layout.segments)]
        self.unit_of_paged = {x: u for u, (k, x) in enumerate(self.units) if k == "paged"}
        self.unit_of_segment = {x: u for u, (k, x) in enumerate(self.units) if k == "segment"}
        self.unit_bytes = np.array([itemsize * (block_size * layout.paged[x] if k == "paged"
                                                else block_size // m * layout.segments[x]) for k, x in self.units],
                                   dtype=np.int64)
        U = len(self.units)
        self._rc = np.zeros((U, num_blocks), dtype=np.int32)
        self._free_units = np.full(num_blocks, U, dtype=np.int32)  # units in which a block id is free
        self._free_q: deque[int] = deque(range(num_blocks))  # ids free in every unit (stale entries skipped)
        # Contiguity: a sequence that says how long it will get claims a run of free ids at its first block
        # and grows into it, so its blocks stay consecutive and decode reads them as views of the pools (no
        # gather). A claim is a preference, not a reservation: claimed ids count as free, and other sequences
        # take them only when no unclaimed id is left.
        self._claim = np.full(num_blocks, -1, dtype=np.int64)  # claiming sequence of a free id, -1: none
        self._free_slots: deque[int] = deque(range(max_seqs))
        self._seqs: dict[int, _Sequence] = {}
        self._next_id = 0
        self.block_bytes = itemsize * (block_size * sum(layout.paged.values())
                                       + block_size // m * sum(layout.segments.values()))
        self.slot_bytes = itemsize * (m - 1) * sum(layout.pending.values())

    # ---- sequences ---------------------------------------------------------------------------------
    def add_sequence(self, expect_tokens: int | None = None) -> int:
        """A new empty sequence; its id. Raises CacheFullError when every state slot is taken.

        ``expect_tokens``: how long the sequence may get (e.g. prompt + max new tokens); its first block then
        starts a run of free block ids long enough for that, which it claims and grows into (consecutive
        blocks are read as views, not gathered). Only a preference: nothing is held beyond what is written."""
        if expect_tokens is not None and (isinstance(expect_tokens, bool) or not isinstance(expect_tokens, int)
                                          or expect_tokens < 0):
            raise ValueError(f"expect_tokens ({expect_tokens!r}) must be a non-negative integer or None")
        if not self._free_slots:
            raise CacheFullError(f"all {self.max_seqs} sequence slots are in use")
        seq = self._next_id
        self._next_id += 1
        self._seqs[seq] = _Sequence(self._free_slots.popleft(),
                                    rings=self.window_rings.new_tables(),
                                    expect_blocks=math.ceil(min(expect_tokens or 0, self.max_seq_len) / self.block_size))
        self._clear_state(self._seqs[seq].slot)
        return seq

    def fork(self, seq: int) -> int:
        """A new sequence holding the same tokens: same blocks and ring blocks (reference counted, not
        copied), a copy of the per-sequence state. Later writes of either side copy a shared block first."""
        src = self._get(seq)
        child = self.add_sequence()
        c = self._seqs[child]
        c.spans, c.length = [[u, list(t)] for u, t in src.spans], src.length
        self._incref_spans(c.spans)
        c.rings = [list(t) for t in src.rings]
        self.window_rings.hold(c.rings)
        for t in self.pending.values():
            t[c.slot] = t[src.slot]
        return child

    def snapshot(self, seq: int) -> CacheSnapshot:
        """Freeze ``seq`` as it is now: hold its blocks and ring blocks (the sequence may go on; its next
        write into a held block copies it first) and copy its per-sequence state."""
        s = self._get(seq)
        self._incref_spans(s.spans)
        self.window_rings.hold(s.rings)
        state = {("pending", layer): t[s.slot].clone() for layer, t in self.pending.items()}
        return CacheSnapshot(tuple((u, tuple(t)) for u, t in s.spans), s.length, state,
                             tuple(tuple(t) for t in s.rings))

    def restore(self, snap: CacheSnapshot, recompute_from: int | None = None) -> int:
        """A new sequence holding the snapshot's tokens: its blocks and ring blocks shared (reference
        counted), its state copied into the new sequence's slot.

        ``recompute_from`` (a layer): what layers from there on store is *not* shared; the new sequence
        gets fresh blocks for it, which a replay (``Transformer.replay``) then fills, e.g. for another
        adapter: on a causal encoder-decoder the ring groups from that layer on (a ring-group boundary:
        the pivot; the shared segments stay shared), on a full-attention model every layer's paged KV from
        that layer on over all the snapshot's tokens (the layers below stay shared). Raises CacheFullError
        (changing nothing) when no slot or not enough blocks are free."""
        if snap.released:
            raise ValueError("restore: the snapshot was released")
        need = self.restore_ring_blocks(snap, recompute_from)
        gi = self.window_rings.shortfall(need)
        if gi is not None:
            raise CacheFullError(f"restore needs {need[gi]} ring blocks of group {gi}, "
                                 f"{len(self.ring_groups[gi].free)} free of {self.ring_groups[gi].num_blocks}")
        spans = [[u, list(t)] for u, t in snap.spans]
        cut = self._unit_cut(recompute_from)
        n_blocks = -(-snap.length // self.block_size)
        if cut < len(self.units) and self.block_bytes:  # the units from ``cut`` on come fresh
            if self._available(cut, len(self.units)) < n_blocks:
                raise CacheFullError(f"restore needs {n_blocks} blocks for layers from {recompute_from} on, "
                                     f"{self._available(cut, len(self.units))} free there")
            spans = self._split(spans, cut)
            spans = [sp for sp in spans if sp[0] < cut]
        if not self._free_slots:
            raise CacheFullError(f"all {self.max_seqs} sequence slots are in use")
        seq = self.add_sequence()
        s = self._seqs[seq]
        fresh_span = cut < len(self.units) and self.block_bytes
        s.spans, s.length = spans + ([[cut, []]] if fresh_span else []), snap.length
        self._incref_spans(s.spans)  # (the fresh span is still empty)
        if fresh_span:
            s.spans[-1][1] = [self._allocate(cut, len(self.units)) for _ in range(n_blocks)]
        self.window_rings.restore(s.rings, snap.rings, need)
        for (kind, layer), t in snap.state.items():
            self.pending[layer][s.slot] = t
        return seq

    def restore_ring_blocks(self, snap: CacheSnapshot, recompute_from: int | None = None) -> dict[int, int]:
        """Fresh ring blocks per ring group that ``restore(snap, recompute_from)`` takes."""
        return self.window_rings.restore_blocks(snap.length, recompute_from)

    def release(self, snap: CacheSnapshot) -> None:
        """Let a snapshot's blocks go (freed when no sequence or other snapshot holds them)."""
        if snap.released:
            return
        self._release_spans(snap.spans)
        self.window_rings.release(snap.rings)
        snap.released = True

    def free(self, seq: int) -> None:
        """Release a sequence: its blocks (when no other sequence holds them) and its state slot."""
        s = self._seqs.pop(seq, None)
        if s is None:
            raise KeyError(f"unknown sequence {seq}")
        self._release_spans(s.spans)
        self.window_rings.release(s.rings)
        self._free_slots.append(s.slot)
        if s.expect_blocks:
            self._claim[self._claim == seq] = -1

    def length(self, seq: int) -> int:
        return self._get(seq).length

    def block_table(self, seq: int, unit: int = 0) -> list[int]:
        """Block ids of ``seq`` for ``unit`` (a paged layer or segment: ``unit_of_paged`` /
        ``unit_of_segment``; by default the first)."""
        return list(self._table(self._get(seq), unit))

    def span_starts(self, seq: int) -> list[int]:
        """First unit of each of ``seq``'s layer spans ([0] unless a restore split its layers)."""
        return [u for u, _ in self._get(seq).spans]

    def spans(self, seq: int) -> list[tuple[int, list[int]]]:
        """``seq``'s layer spans: (first unit, block ids); one span unless a restore split its layers."""
        return [(u, list(t)) for u, t in self._get(seq).spans]

    def ring_table(self, seq: int, group: int) -> list[int]:
        """Ring-block ids of ``seq``'s ring group ``group`` (-1: not written yet)."""
        return list(self._get(seq).rings[group])

    def ring(self, seq: int, layer: int) -> torch.Tensor:
        """A copy of ``seq``'s ring of ``layer``, (ring_len, width) by ring slot (zeros where never written)."""
        return self.window_rings.ring(self._get(seq).rings[self.ring_group_of[layer]], layer)

    def slot(self, seq: int) -> int:
        return self._get(seq).slot

    def refcount(self, block: int, unit: int = 0) -> int:
        return int(self._rc[unit, block]) if self.units else 0

    def ring_refcount(self, group: int, block: int) -> int:
        return self.ring_groups[group].refcount[block]

    @property
    def sequences(self) -> list[int]:
        return list(self._seqs)

    # ---- allocation ------------------------------------------------------------------------------
    def blocks_needed(self, seq: int, new_tokens: int) -> int:
        """Free token blocks that ``extend(seq, new_tokens)`` would take (new blocks plus copy on write),
        summed over the sequence's layer spans."""
        return sum(self._span_needs(self._get(seq), new_tokens).values())

    def _span_needs(self, s: _Sequence, new_tokens: int) -> dict[int, int]:
        """Span index -> blocks it needs for ``new_tokens`` more tokens."""
        if not self.block_bytes:
            return {}
        end = s.length + new_tokens
        first = s.length // self.block_size  # the block the next token lands in
        out = {}
        for i, (u, table) in enumerate(s.spans):
            need = max(0, math.ceil(end / self.block_size) - len(table))
            if new_tokens and first < len(table) and self._shared(i, s, table[first]):
                need += 1
            out[i] = need
        return out

    def _shared(self, i: int, s: _Sequence, b: int) -> bool:
        lo, hi = self._span_range(s, i)
        return bool((self._rc[lo:hi, b] > 1).any())

    def ring_blocks_needed(self, seq: int, start: int, n: int, groups=None) -> dict[int, int]:
        """Per ring group, free ring blocks that writing positions [start, start + n) takes (blocks never
        written plus copies of shared ones)."""
        return self.window_rings.needed(self._get(seq).rings, start, n, groups)

    def reserve_rings(self, seq: int, start: int, n: int, groups=None) -> None:
        """Make the ring blocks that positions [start, start + n) write private to ``seq`` (allocate blocks
        never written, copy shared ones first), in ``groups`` (default all)."""
        need = self.ring_blocks_needed(seq, start, n, groups)
        gi = self.window_rings.shortfall(need)
        if gi is not None:
            raise CacheFullError(f"sequence {seq} needs {need[gi]} more ring blocks of group {gi}, "
                                 f"{len(self.ring_groups[gi].free)} free of {self.ring_groups[gi].num_blocks}")
        self.window_rings.reserve(self._get(seq).rings, need, start, n)

    def can_extend(self, seq: int, new_tokens: int) -> bool:
        s = self._get(seq)
        if s.length + new_tokens > self.max_seq_len:
            return False
        for i, k in self._span_needs(s, new_tokens).items():
            if k and k > self._available(*self._span_range(s, i)):
                return False
        return self.window_rings.shortfall(self.ring_blocks_needed(seq, s.length, new_tokens)) is None

    def extend(self, seq: int, new_tokens: int) -> None:
        """Make room for ``new_tokens`` more tokens: allocate blocks, copy a shared block before it is written."""
        s = self._get(seq)
        end = s.length + new_tokens
        if end > self.max_seq_len:
            raise ValueError(f"cache overflow: {end} tokens > max_seq_len {self.max_seq_len}; allocate a longer cache")
        needs = self._span_needs(s, new_tokens)
        for i, k in needs.items():
            if k and k > self._available(*self._span_range(s, i)):
                raise CacheFullError(
                    f"sequence {seq} needs {self.blocks_needed(seq, new_tokens)} more blocks for {new_tokens} tokens, "
                    f"{self._available(*self._span_range(s, i))} free of {self.num_blocks}")
        self.reserve_rings(seq, s.length, new_tokens)
        if not self.block_bytes:
            return
        first = s.length // self.block_size
        for i, (u, table) in enumerate(s.spans):
            lo, hi = self._span_range(s, i)
            if new_tokens and first < len(table) and self._shared(i, s, table[first]):
                old, new = table[first], self._allocate(lo, hi)
                for k, x in self.units[lo:hi]:
                    t = self.paged[x] if k == "paged" else self.segments[x]
                    if x in self.head_major and k == "paged":
                        t[:, new] = t[:, old]
                    else:
                        t[new] = t[old]
                self._release_ids(lo, hi, [old])
                table[first] = new
            while len(table) * self.block_size < end:
                if lo == 0 and hi == len(self.units) and s.expect_blocks:
                    table.append(self._allocate_for(seq, s, table))
                else:
                    table.append(self._allocate(lo, hi))

    def commit(self, seq: int, new_tokens: int) -> None:
        """Record ``new_tokens`` written (called once per forward, after every layer ran)."""
        self._get(seq).length += new_tokens

    # ---- accounting ------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes allocated for the pools, rings and state slots (fixed at construction)."""
        pools = (self.paged, self.segments, self.rings, self.pending)
        return sum(t.numel() * t.element_size() for p in pools for t in p.values())

    @property
    def free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def free_blocks(self) -> int:
        """Block ids free in every layer."""
        return int(np.count_nonzero(self._free_units == len(self.units))) if self.units else self.num_blocks

    @property
    def used_bytes(self) -> int:
        """Bytes of blocks (per layer) and ring blocks held by some sequence or snapshot plus the state
        slots of live sequences."""
        blocks = int(((self._rc > 0).sum(1) * self.unit_bytes).sum()) if self.units else 0
        return blocks + self.window_rings.used_bytes + len(self._seqs) * self.slot_bytes

    @property
    def shared_bytes(self) -> int:
        """Bytes of blocks (per layer) and ring blocks held more than once (by several sequences or
        snapshots), each counted once."""
        blocks = int(((self._rc > 1).sum(1) * self.unit_bytes).sum()) if self.units else 0
        return blocks + self.window_rings.shared_bytes

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

    def _table(self, s: _Sequence, unit: int) -> list[int]:
        for u, t in reversed(s.spans):
            if u <= unit:
                return t
        raise AssertionError("spans start at unit 0")

    def _span_range(self, s: _Sequence, i: int) -> tuple[int, int]:
        return s.spans[i][0], (s.spans[i + 1][0] if i + 1 < len(s.spans) else len(self.units))

    def _unit_cut(self, recompute_from: int | None) -> int:
        """The first unit a restore with ``recompute_from`` gives fresh blocks (len(units): none). On a
        causal encoder-decoder the segments stay shared (a replay rebuilds window rings only)."""
        if recompute_from is None or self.config.is_ced:
            return len(self.units)
        return next((u for u, (k, x) in enumerate(self.units) if x >= recompute_from), len(self.units))

    @staticmethod
    def _split(spans: list[list], cut: int) -> list[list]:
        """Spans with a boundary at unit ``cut`` (the table is the same on both sides)."""
        out = []
        for i, (u, t) in enumerate(spans):
            end = spans[i + 1][0] if i + 1 < len(spans) else None
            out.append([u, list(t)])
            if u < cut and (end is None or cut < end):
                out.append([cut, list(t)])
        return out

    def _available(self, lo: int, hi: int) -> int:
        """Block ids free in every unit of [lo, hi)."""
        if lo == 0 and hi == len(self.units):
            return int(np.count_nonzero(self._free_units == hi))
        return int(np.count_nonzero((self._rc[lo:hi] == 0).all(0)))

    def _allocate(self, lo: int = 0, hi: int | None = None) -> int:
        """A block id free in units [lo, hi), now held once there. All units: the oldest fully free id;
        a span: preferably an id some other span already holds (keeping fully free ids whole)."""
        U = len(self.units)
        hi = U if hi is None else hi
        if lo == 0 and hi == U:
            claimed = []  # free ids claimed by a growing sequence: taken only when nothing else is free
            while True:
                if not self._free_q:
                    if not claimed:
                        raise CacheFullError(f"no free block ({self.num_blocks} in all)")
                    b = claimed.pop(0)
                    break
                b = self._free_q.popleft()
                if self._free_units[b] == U:
                    if self._claim[b] < 0:
                        break
                    claimed.append(b)
            self._free_q.extendleft(reversed(claimed))
            self._claim[b] = -1
        else:
            free = (self._rc[lo:hi] == 0).all(0)
            idx = np.flatnonzero(free & (self._free_units < U))
            if not idx.size:
                idx = np.flatnonzero(free)
            if not idx.size:
                raise CacheFullError(f"no block free in layers {self.units[lo][1]}..{self.units[hi - 1][1]}")
            b = int(idx[0])
        self._rc[lo:hi, b] = 1
        self._free_units[b] -= hi - lo
        return b

    def _allocate_for(self, seq: int, s: _Sequence, table: list[int]) -> int:
        """The next block of ``seq``'s (all-unit) table: the id after its last one when free and not claimed
        by another sequence; for its first block, the start of the first free run of ``expect_blocks``
        unclaimed ids (claimed for it); else any id, unclaimed ones first."""
        U = len(self.units)
        if table:
            b = table[-1] + 1
            if b < self.num_blocks and self._free_units[b] == U and self._claim[b] in (-1, seq):
                return self._take(b)
        else:
            free = (self._free_units == U) & (self._claim < 0)
            n = min(s.expect_blocks, self.num_blocks)
            if n > 1:
                # run starts: free ids with n free ids from there (a sliding window sum over the free mask)
                c = np.concatenate([[0], np.cumsum(free, dtype=np.int64)])
                starts = np.flatnonzero(c[n:] - c[:-n] == n)
                if starts.size:
                    b = int(starts[0])
                    self._claim[b + 1:b + n] = seq
                    return self._take(b)
        return self._allocate()

    def _take(self, b: int) -> int:
        """Hold free id ``b`` in every unit (its stale entry in the free queue is skipped later)."""
        self._rc[:, b] = 1
        self._free_units[b] = 0
        self._claim[b] = -1
        return b

    def _incref_spans(self, spans) -> None:
        for i, (u, t) in enumerate(spans):
            if t:
                hi = spans[i + 1][0] if i + 1 < len(spans) else len(self.units)
                self._rc[u:hi, np.asarray(t, dtype=np.int64)] += 1

    def _release_ids(self, lo: int, hi: int, ids) -> None:
        if not len(ids):
            return
        ix = np.asarray(ids, dtype=np.int64)
        self._rc[lo:hi, ix] -= 1
        self._free_units[ix] += (self._rc[lo:hi, ix] == 0).sum(0).astype(np.int32)
        U = len(self.units)
        for b in ix[self._free_units[ix] == U].tolist():
            self._free_q.append(b)
        if len(self._free_q) > 2 * self.num_blocks:  # ids taken outside the queue left stale entries: compact
            self._free_q = deque(np.flatnonzero(self._free_units == U).tolist())

    def _release_spans(self, spans) -> None:
        for i, (u, t) in enumerate(spans):
            hi = spans[i + 1][0] if i + 1 < len(spans) else len(self.units)
            self._release_ids(u, hi, t)

    def _clear_state(self, slot: int) -> None:
        for t in self.pending.values():
            t[slot].zero_()


def ring_geometry(config: ModelConfig, block_size: int, max_seq_len: int) -> tuple[int, int, int]:
    """(ring length R = min(W, max_seq_len), ring block rb = gcd(R, block_size), ring blocks per sequence
    and group R / rb); zeros without window layers."""
    layout = cache_layout(config)
    return ring_shape(layout.window if layout.rings else None, block_size, max_seq_len)


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
    return cache, [cache.add_sequence(expect_tokens=max_len) for _ in range(batch_size)]
