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
  by reference count with copy on write like token blocks, in ring groups (:class:`PagedKVCache`).
- **Per-sequence state**: each kv_source layer with m > 1 keeps the entries and gate scores of the (at
  most m - 1) tokens of its incomplete block. A sequence takes one state slot; a fork copies it.

Each forward step is planned over the cache's tables by :func:`kvgraft.model.plan.plan_step`; layers never
touch the pools directly. What a cache of given arguments holds and costs: :mod:`kvgraft.model.sizes`.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvgraft.checks import check_int
from kvgraft.model.blocks import BlockAllocator, CacheFullError, lazy_zeros
from kvgraft.model.config import ModelConfig, cache_layout
from kvgraft.model.rings import WindowRings
from kvgraft.model.sizes import default_block_size

__all__ = ["CacheSnapshot", "PagedKVCache", "static_cache"]


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
    spans: list[list[Any]] = field(default_factory=lambda: [[0, []]])  # [first unit, block ids] per layer span
    length: int = 0  # tokens committed
    rings: list[list[int]] = field(default_factory=list)  # per ring group: ring-block ids, -1 = not allocated
    expect_blocks: int = 0  # blocks the sequence expects to fill (add_sequence(expect_tokens=)); 0: unknown


class PagedKVCache:
    """Paged pools + paged window rings + per-sequence state slots; every block (token blocks here, ring blocks
    in each ring group) comes from the one allocator class, :class:`kvgraft.model.blocks.BlockAllocator`.

    ``num_blocks`` token blocks of ``block_size`` tokens are shared by all sequences; ``max_seqs`` sequences
    can be live at once; ``max_seq_len`` bounds one sequence (and sizes the rings: ``min(W, max_seq_len)``).
    ``ring_blocks``: ring blocks per ring group (default: every live sequence's whole rings,
    ``max_seqs * ring_len / ring_block``, the memory of one ring per slot; more leaves room for snapshots
    that keep rings after their sequence moved on). ``ring_split``: the first layer of the second ring
    group (default: a causal encoder-decoder's pivot, the last kv_source layer; None: one group).

    Ring groups: the ring layers are split into groups that share one ring-block table per sequence: on a
    causal encoder-decoder, the layers before the pivot (the last kv_source layer: the *encoder*, whose windows a
    certified adapter never changes) and the layers from the pivot on (the *decoder*). Sequences started from one
    snapshot (N adapters over one prompt) reference the encoder's ring blocks and the shared segments, and hold
    only their own decoder rings (:meth:`restore` with ``recompute_from``); a step that writes into a shared ring
    block copies that block first (one ring block per group per decode step at most). The ring pools and ring
    groups are :class:`kvgraft.model.rings.WindowRings`, which the cache owns.

    Every block, a token block or a ring block, is handed out by one allocator class,
    :class:`kvgraft.model.blocks.BlockAllocator` (reference counts per pool, copy on write decided here): one
    instance for the token blocks, one per ring group. ``cache_layout(config)`` (defined with the config,
    :mod:`kvgraft.model.config`, and handed on here) is the one table of what each layer stores;
    ``ModelConfig.kv_cache_bytes`` and this class's allocation both derive from it (tested equal). Layers never
    touch the pools directly: each forward step is planned over this cache (:func:`kvgraft.model.plan.plan_step`,
    an immutable :class:`kvgraft.model.plan.StepPlan` built from per-slot arrays kept here), and
    :class:`kvgraft.model.batch.BatchContext` holds the plan and hands the layers typed views
    (:mod:`kvgraft.model.views`) for that step.
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
            check_int(name, value, low=1)
        max_seq_len = num_blocks * block_size if max_seq_len is None else max_seq_len
        check_int("max_seq_len", max_seq_len, low=1)
        self.layout = layout = cache_layout(config)
        m = layout.compress_rate
        if block_size % m:
            raise ValueError(
                f"block_size ({block_size}) must be a multiple of compress_rate ({m}): a block holds whole pooled entries"
            )
        self.config, self.block_size, self.num_blocks, self.max_seqs = config, block_size, num_blocks, max_seqs
        self.max_seq_len, self.dtype, self.device = max_seq_len, dtype, torch.device(device)
        if isinstance(ring_split, str):
            if ring_split != "pivot":
                raise ValueError(
                    f"ring_split ({ring_split!r}) must be a layer index in [0, {config.num_layers}], 'pivot' or None"
                )
            ring_split = max(config.kv_source_layers) if config.kv_source_layers else None
        # window rings: their pools and ring groups (a sequence keeps its ring-block tables)
        self.window_rings = wr = WindowRings(config, block_size, max_seq_len, max_seqs, ring_blocks, ring_split, dtype, device)
        self.ring_len, self.ring_block, self.ring_blocks_per_seq = wr.ring_len, wr.ring_block, wr.blocks_per_seq
        self.ring_split, self.ring_groups, self.ring_group_of, self.rings = wr.split, wr.groups, wr.group_of, wr.pools

        def zeros(*shape: int) -> torch.Tensor:
            return lazy_zeros(shape, dtype, device)

        itemsize = torch.empty((), dtype=dtype).element_size()
        # GQA layers store keys and values head-major, (2K, blocks, block_size, head_dim): gathering a batch's
        # blocks then yields each head's keys contiguous, which decode attention reads without another copy.
        # Other paged layers store one row per token, (blocks, block_size, width).
        self.head_major = {
            layer: (2 * config.num_kv_heads, config.head_dim) for layer in layout.paged if config.attention_kinds[layer] == "gqa"
        }
        self.paged = {
            layer: zeros(self.head_major[layer][0], num_blocks, block_size, self.head_major[layer][1])
            if layer in self.head_major
            else zeros(num_blocks, block_size, w)
            for layer, w in layout.paged.items()
        }
        self.segments = {s: zeros(num_blocks, block_size // m, w) for s, w in layout.segments.items()}
        self.pending = {s: zeros(max_seqs, m - 1, w) for s, w in layout.pending.items()}
        # token blocks: one id space, a reference count per (unit, block): a unit is a paged layer or a
        # segment; a sequence's layers share one block table except where a restore split them into spans
        self.units = [("paged", x) for x in sorted(layout.paged)] + [("segment", x) for x in sorted(layout.segments)]
        self.unit_of_paged = {x: u for u, (k, x) in enumerate(self.units) if k == "paged"}
        self.unit_of_segment = {x: u for u, (k, x) in enumerate(self.units) if k == "segment"}
        self.unit_bytes = np.array(
            [
                itemsize * (block_size * layout.paged[x] if k == "paged" else block_size // m * layout.segments[x])
                for k, x in self.units
            ],
            dtype=np.int64,
        )
        # token blocks (a sequence that says how long it will get claims a run of consecutive ids and grows
        # into it, so decode reads its blocks as views of the pools)
        self.blocks = BlockAllocator(len(self.units), num_blocks, tuple(x for _, x in self.units))
        # each state slot's *home*: blocks [slot * home_stride, (slot + 1) * home_stride). A sequence that says
        # how long it will get (at most home_stride blocks) starts its run there, so a batch of sequences at
        # home reads every paged pool as one strided view, (slots, home_stride * block_size, ...), no gather
        self.home_stride = num_blocks // max_seqs
        self._free_slots: deque[int] = deque(range(max_seqs))
        # per state slot, arrays a step is planned from (kvgraft.model.plan: no loop over rows), kept in step with
        # every allocation by _mirror: the first layer span's block table (-1 past its blocks), its block count,
        # the tokens committed, whether a restore split the layers into spans, and per ring group the
        # ring-block table (-1: never written)
        # (a table holds distinct ids: at most num_blocks of them, however long max_seq_len is)
        self.slot_tables = np.full((max_seqs, min(-(-max_seq_len // block_size), num_blocks)), -1, dtype=np.int64)
        self.slot_nblocks = np.zeros(max_seqs, dtype=np.int64)
        self.slot_lengths = np.zeros(max_seqs, dtype=np.int64)
        self.slot_split = np.zeros(max_seqs, dtype=bool)
        self.slot_rings = [np.full((max_seqs, self.ring_blocks_per_seq), -1, dtype=np.int64) for _ in self.ring_groups]
        self._seqs: dict[int, _Sequence] = {}
        self._next_id = 0
        self.block_bytes = itemsize * (block_size * sum(layout.paged.values()) + block_size // m * sum(layout.segments.values()))
        self.slot_bytes = itemsize * (m - 1) * sum(layout.pending.values())

    # ---- sequences ---------------------------------------------------------------------------------
    def add_sequence(self, expect_tokens: int | None = None) -> int:
        """A new empty sequence; its id. Raises CacheFullError when every state slot is taken.

        ``expect_tokens``: how long the sequence may get (e.g. prompt + max new tokens); its first block then
        starts a run of free block ids long enough for that, which it claims and grows into (consecutive
        blocks are read as views, not gathered). Only a preference: nothing is held beyond what is written."""
        check_int("expect_tokens", expect_tokens, low=0, optional=True)
        if not self._free_slots:
            raise CacheFullError(f"all {self.max_seqs} sequence slots are in use")
        seq = self._next_id
        self._next_id += 1
        self._seqs[seq] = _Sequence(
            self._free_slots.popleft(),
            rings=self.window_rings.new_tables(),
            expect_blocks=math.ceil(min(expect_tokens or 0, self.max_seq_len) / self.block_size),
        )
        self._clear_state(self._seqs[seq].slot)
        self._mirror(self._seqs[seq])
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
        self._mirror(c)
        return child

    def snapshot(self, seq: int) -> CacheSnapshot:
        """Freeze ``seq`` as it is now: hold its blocks and ring blocks (the sequence may go on; its next
        write into a held block copies it first) and copy its per-sequence state."""
        s = self._get(seq)
        self._incref_spans(s.spans)
        self.window_rings.hold(s.rings)
        state = {("pending", layer): t[s.slot].clone() for layer, t in self.pending.items()}
        return CacheSnapshot(tuple((u, tuple(t)) for u, t in s.spans), s.length, state, tuple(tuple(t) for t in s.rings))

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
            raise CacheFullError(
                f"restore needs {need[gi]} ring blocks of group {gi}, "
                f"{self.ring_groups[gi].blocks.free_count} free of {self.ring_groups[gi].num_blocks}"
            )
        spans: list[list[Any]] = [[u, list(t)] for u, t in snap.spans]
        cut = self._unit_cut(recompute_from)
        n_blocks = -(-snap.length // self.block_size)
        if cut < len(self.units) and self.block_bytes:  # the units from ``cut`` on come fresh
            if self.blocks.available(cut, len(self.units)) < n_blocks:
                raise CacheFullError(
                    f"restore needs {n_blocks} blocks for layers from {recompute_from} on, "
                    f"{self.blocks.available(cut, len(self.units))} free there"
                )
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
            s.spans[-1][1] = [self.blocks.allocate(cut, len(self.units)) for _ in range(n_blocks)]
        self.window_rings.restore(s.rings, snap.rings, need)
        for (kind, layer), t in snap.state.items():
            self.pending[layer][s.slot] = t
        self._mirror(s)
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
            self.blocks.unclaim(seq)

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

    def at_home(self, seqs: list[int]) -> list[bool]:
        """Whether each sequence's blocks are its slot's home run, in order (one layer span, at most
        ``home_stride`` blocks): :meth:`slots_at_home` of their slots."""
        ok: list[bool] = self.slots_at_home(np.array([self._get(q).slot for q in seqs], dtype=np.int64)).tolist()
        return ok

    def home_range(
        self, table: torch.Tensor, slots: torch.Tensor, ends: list[int]
    ) -> tuple[int, int, torch.Tensor | None] | None:
        """For rows with block tables ``table`` (G, blocks; padding past each row's blocks), state ``slots``
        (G,) and lengths ``ends`` after the step: (first slot, end slot, each row's place in that range, or
        None when the rows are the range in order) when every row's blocks are its home run, so the rows
        read each pool as ``home_view(pool, first, end, ...)``; else None. A range of at least half the
        slots is widened to all of them (heads and slots then share one stride: one matmul reads it)."""
        nb = table.shape[1]
        if not self.home_stride or nb > self.home_stride:
            return None
        ar = torch.arange(nb, device=table.device)
        used = ar[None] < -(-torch.tensor(ends, device=table.device)[:, None] // self.block_size)
        if not bool(((table == slots[:, None] * self.home_stride + ar[None]) | ~used).all()):
            return None
        lo, hi = int(slots.min()), int(slots.max()) + 1
        if 2 * len(ends) >= self.max_seqs:
            lo, hi = 0, self.max_seqs
        index = slots - lo
        in_order = hi - lo == len(ends) and bool((index == torch.arange(len(ends), device=index.device)).all())
        return lo, hi, None if in_order else index

    def home_run(self, seq: int) -> tuple[int, int]:
        """The block ids [lo, hi) ``seq`` expects to fill in its slot's home run (empty when it said no length
        or expects more than a home run holds)."""
        s = self._get(seq)
        lo = s.slot * self.home_stride
        return lo, lo + (s.expect_blocks if 0 < s.expect_blocks <= self.home_stride else 0)

    def relocate(self, snap: CacheSnapshot, lo: int, hi: int) -> CacheSnapshot | None:
        """The snapshot with its blocks in [lo, hi) copied to free unclaimed ids outside that run (the ends of
        home runs first), as a new snapshot that takes over the old one's holds (the old is released); None,
        changing nothing, when the snapshot's layers are split into spans or too few such ids are free."""
        if snap.released or len(snap.spans) != 1 or snap.spans[0][0] != 0:
            return None
        ids = list(snap.spans[0][1])
        moved: list[tuple[int, int]] = []
        for i, b in enumerate(ids):
            if lo <= b < hi:
                new = self.blocks.take_outside(lo, hi, self.home_stride)
                if new is None:
                    self.blocks.release(0, len(self.units), [n for _, n in moved])
                    return None
                moved.append((b, new))
                ids[i] = new
        for old, new in moved:  # every unit of the one span: paged layers and segments
            for kind, x in self.units:
                t = self.paged[x] if kind == "paged" else self.segments[x]
                if kind == "paged" and x in self.head_major:
                    t[:, new] = t[:, old]
                else:
                    t[new] = t[old]
        self.blocks.release(0, len(self.units), [old for old, _ in moved])
        out = CacheSnapshot(((0, tuple(ids)),), snap.length, snap.state, snap.rings)
        snap.rings, snap.released = (), True  # its holds are the new snapshot's now
        return out

    def home_view(self, pool: torch.Tensor, lo: int, hi: int, tokens: int, dim: int = 0) -> torch.Tensor:
        """The home runs of slots [lo, hi) of a paged pool whose block axis is ``dim`` (0, or 1 for the
        head-major GQA pools), their first ``tokens`` positions: a view, (.., hi - lo, tokens, ..). A batch context reads a group this way when every row's blocks are
        its home run, in order (``kvgraft.model.batch``)."""
        per = self.home_stride * self.block_size
        flat = pool.narrow(dim, 0, self.max_seqs * self.home_stride)
        shape = list(flat.shape)
        shape[dim : dim + 2] = [self.max_seqs, per]
        return flat.view(shape).narrow(dim, lo, hi - lo).narrow(dim + 1, 0, tokens)

    def refcount(self, block: int, unit: int = 0) -> int:
        return self.blocks.refcount(block, unit) if self.units else 0

    def ring_refcount(self, group: int, block: int) -> int:
        return int(self.ring_groups[group].refcount[block])

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
        return self.blocks.shared(*self._span_range(s, i), b)

    def ring_blocks_needed(self, seq: int, start: int, n: int, groups: Collection[int] | None = None) -> dict[int, int]:
        """Per ring group, free ring blocks that writing positions [start, start + n) takes (blocks never
        written plus copies of shared ones)."""
        return self.window_rings.needed(self._get(seq).rings, start, n, groups)

    def reserve_rings(self, seq: int, start: int, n: int, groups: Collection[int] | None = None) -> None:
        """Make the ring blocks that positions [start, start + n) write private to ``seq`` (allocate blocks
        never written, copy shared ones first), in ``groups`` (default all)."""
        need = self.ring_blocks_needed(seq, start, n, groups)
        gi = self.window_rings.shortfall(need)
        if gi is not None:
            raise CacheFullError(
                f"sequence {seq} needs {need[gi]} more ring blocks of group {gi}, "
                f"{self.ring_groups[gi].blocks.free_count} free of {self.ring_groups[gi].num_blocks}"
            )
        s = self._get(seq)
        self.window_rings.reserve(s.rings, need, start, n)
        for g, t in zip(self.slot_rings, s.rings):
            g[s.slot] = t

    def can_extend(self, seq: int, new_tokens: int) -> bool:
        s = self._get(seq)
        if s.length + new_tokens > self.max_seq_len:
            return False
        for i, k in self._span_needs(s, new_tokens).items():
            if k and k > self.blocks.available(*self._span_range(s, i)):
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
            if k and k > self.blocks.available(*self._span_range(s, i)):
                raise CacheFullError(
                    f"sequence {seq} needs {self.blocks_needed(seq, new_tokens)} more blocks for {new_tokens} tokens, "
                    f"{self.blocks.available(*self._span_range(s, i))} free of {self.num_blocks}"
                )
        self.reserve_rings(seq, s.length, new_tokens)
        if not self.block_bytes:
            return
        grew = len(s.spans[0][1])
        first = s.length // self.block_size
        for i, (u, table) in enumerate(s.spans):
            lo, hi = self._span_range(s, i)
            if new_tokens and first < len(table) and self._shared(i, s, table[first]):
                old, new = table[first], self.blocks.allocate(lo, hi)
                for kind, x in self.units[lo:hi]:
                    t = self.paged[x] if kind == "paged" else self.segments[x]
                    if x in self.head_major and kind == "paged":
                        t[:, new] = t[:, old]
                    else:
                        t[new] = t[old]
                self.blocks.release(lo, hi, [old])
                table[first] = new
            while len(table) * self.block_size < end:
                if lo == 0 and hi == len(self.units) and s.expect_blocks:
                    home = s.slot * self.home_stride if s.expect_blocks <= self.home_stride else None
                    table.append(self.blocks.allocate_next(seq, table, s.expect_blocks, home))
                else:
                    table.append(self.blocks.allocate(lo, hi))
        t0, k = s.spans[0][1], min(first, grew)
        self.slot_tables[s.slot, k : len(t0)] = t0[k:]  # the block copied on write and the new ones
        self.slot_nblocks[s.slot] = len(t0)

    def commit(self, seq: int, new_tokens: int) -> None:
        """Record ``new_tokens`` written (called once per forward, after every layer ran)."""
        s = self._get(seq)
        s.length += new_tokens
        self.slot_lengths[s.slot] = s.length

    def reserved(self, slots: np.ndarray, new_tokens: np.ndarray) -> np.ndarray:
        """Per row (state ``slots``, adding ``new_tokens``): whether ``extend`` has nothing left to do, its
        blocks for the new tokens held and the block it writes first its own (no copy on write), checked with
        array ops over the slot tables; with window rings, also the ring block its one new token writes in each
        ring group held and its own (the slot ring tables). Rows of a split sequence, and rows adding more than
        one token to a cache with window rings, answer False (``extend`` decides for them)."""
        if not self.block_bytes:
            return np.zeros(len(slots), dtype=bool)
        length = self.slot_lengths[slots]
        ends = length + new_tokens
        ok = (ends <= self.max_seq_len) & ~self.slot_split[slots] & (self.slot_nblocks[slots] * self.block_size >= ends)
        first = self.slot_tables[slots, np.minimum(length // self.block_size, self.slot_tables.shape[1] - 1)]
        ok &= first >= 0
        out: np.ndarray = ok & ~(self.blocks.rc[:, np.maximum(first, 0)] > 1).any(0)
        if self.ring_groups:  # the ring block position `length` lands in (WindowRings.touched for one token)
            wr = self.window_rings
            assert wr.window is not None
            k = np.minimum((length % wr.window) // wr.ring_block, wr.blocks_per_seq - 1)
            out &= new_tokens == 1
            for table, group in zip(self.slot_rings, self.ring_groups):
                b = table[slots, k]
                out &= (b >= 0) & (group.refcount[np.maximum(b, 0)] == 1)
        return out

    def slots_at_home(self, slots: np.ndarray) -> np.ndarray:
        """Per state slot: whether its sequence's blocks are the slot's home run, in order (one layer span, at
        most ``home_stride`` blocks), compared over the slot tables (the longest table among the rows bounds
        the comparison, as in :meth:`at_home`)."""
        whole = ~self.slot_split[slots]
        nb = int(self.slot_nblocks[slots][whole].max()) if whole.any() else 0
        if not nb or nb > self.home_stride:
            return np.zeros(len(slots), dtype=bool)
        table = self.slot_tables[slots, :nb]
        want = slots[:, None] * self.home_stride + np.arange(nb)
        ok: np.ndarray = ((table == want) | (table == -1)).all(1) & whole
        return ok

    def _mirror(self, s: _Sequence) -> None:
        """Write ``s``'s tables, length and span split into its slot's arrays (``slot_tables``, ...)."""
        t0, row = s.spans[0][1], self.slot_tables[s.slot]
        row.fill(-1)
        row[: len(t0)] = t0
        self.slot_nblocks[s.slot] = len(t0)
        self.slot_lengths[s.slot] = s.length
        self.slot_split[s.slot] = len(s.spans) > 1
        for g, t in zip(self.slot_rings, s.rings):
            g[s.slot] = t

    def prefault(self) -> None:
        """Write every memory page of the pools, rings and state slots now (they hold zeros and still do), so no
        step pays for the first write of a page: CPU pools are mapped on first write (``lazy_zeros``), and a
        page's first write is the dear part of a cold step on a VM. Takes the pools' memory at once, as a cache
        zeroed at start does (vLLM's)."""
        for pool in (self.paged, self.segments, self.rings, self.pending):
            for t in pool.values():
                if t.device.type == "cpu" and t.numel():
                    flat = t.view(-1)
                    flat[:: max(1, 4096 // t.element_size())].zero_()  # one write a 4 KiB page

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
        return self.blocks.free_count

    @property
    def used_bytes(self) -> int:
        """Bytes of blocks (per layer) and ring blocks held by some sequence or snapshot plus the state
        slots of live sequences."""
        blocks = int((self.blocks.held_per_unit() * self.unit_bytes).sum())
        return blocks + self.window_rings.used_bytes + len(self._seqs) * self.slot_bytes

    @property
    def shared_bytes(self) -> int:
        """Bytes of blocks (per layer) and ring blocks held more than once (by several sequences or
        snapshots), each counted once."""
        blocks = int((self.blocks.held_per_unit(2) * self.unit_bytes).sum())
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
                table: list[int] = t
                return table
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
    def _split(spans: list[list[Any]], cut: int) -> list[list[Any]]:
        """Spans with a boundary at unit ``cut`` (the table is the same on both sides)."""
        out: list[list[Any]] = []
        for i, (u, t) in enumerate(spans):
            end = spans[i + 1][0] if i + 1 < len(spans) else None
            out.append([u, list(t)])
            if u < cut and (end is None or cut < end):
                out.append([cut, list(t)])
        return out

    def _incref_spans(self, spans: list[list[Any]] | tuple[tuple[int, tuple[int, ...]], ...]) -> None:
        for i, (u, t) in enumerate(spans):
            self.blocks.hold(u, spans[i + 1][0] if i + 1 < len(spans) else len(self.units), t)

    def _release_spans(self, spans: list[list[Any]] | tuple[tuple[int, tuple[int, ...]], ...]) -> None:
        for i, (u, t) in enumerate(spans):
            self.blocks.release(u, spans[i + 1][0] if i + 1 < len(spans) else len(self.units), t)

    def _clear_state(self, slot: int) -> None:
        for t in self.pending.values():
            t[slot].zero_()


def static_cache(
    config: ModelConfig,
    batch_size: int,
    max_len: int,
    dtype: torch.dtype,
    device: torch.device | str,
    block_size: int | None = None,
) -> tuple[PagedKVCache, list[int]]:
    """A cache sized for ``batch_size`` sequences of up to ``max_len`` tokens each, and those sequences.

    ``block_size`` defaults to :func:`default_block_size`."""
    check_int("batch_size", batch_size, low=1)
    check_int("max_len", max_len, low=1)
    if block_size is None:
        block_size = default_block_size(config)
    per_seq = math.ceil(max_len / block_size)
    cache = PagedKVCache(
        config,
        num_blocks=batch_size * per_seq,
        block_size=block_size,
        max_seqs=batch_size,
        max_seq_len=max_len,
        dtype=dtype,
        device=device,
    )
    return cache, [cache.add_sequence(expect_tokens=max_len) for _ in range(batch_size)]
