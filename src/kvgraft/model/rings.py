"""Window rings: the bounded storage of sliding-window layers, paged and reference counted.

Every sliding-window layer keeps a *ring* of its last ``W`` tokens per sequence (ring slot ``j`` holds the
latest position ``p`` with ``p % W == j``). A ring is ``R / rb`` *ring blocks* of ``rb = gcd(R, block_size)``
slots (``R = min(W, max_seq_len)``). The ring layers are split into **ring groups** that share one
ring-block table per sequence (a causal encoder-decoder: the layers before its pivot and those from it on);
each group has its own pool of ring blocks, held by reference count with copy on write, so sequences and
snapshots can share ring blocks without seeing each other's writes.

:class:`WindowRings` owns the ring pools and the ring groups; each group takes its ring blocks from the
cache's one allocator class, :class:`kvgraft.model.blocks.BlockAllocator` (one unit: the group's table),
as the token blocks do. A sequence's ring-block tables (one list per group, ``-1`` = never written) live
with the sequence in :class:`kvgraft.model.cache.PagedKVCache`, which owns this object and delegates every
ring operation to it. Capacity errors are raised by the cache.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence

import numpy as np
import torch

from kvgraft.checks import check_int
from kvgraft.errors import ConfigError
from kvgraft.model.blocks import BlockAllocator, lazy_zeros
from kvgraft.model.config import ModelConfig, cache_layout


def ring_shape(window: int | None, block_size: int, max_seq_len: int) -> tuple[int, int, int]:
    """(ring length R = min(W, max_seq_len), ring block rb = gcd(R, block_size), ring blocks per sequence
    and group R / rb); zeros without a window."""
    if not window:
        return 0, 0, 0
    R = min(window, max_seq_len)
    rb = math.gcd(R, block_size)
    return R, rb, R // rb


class RingGroup:
    """Ring layers sharing one ring-block table per sequence. Their ring blocks come from a
    :class:`~kvgraft.model.blocks.BlockAllocator` of one unit (the group's table), reference counted."""

    def __init__(self, layers: tuple[int, ...], num_blocks: int, block_bytes: int) -> None:
        self.layers, self.num_blocks, self.block_bytes = layers, num_blocks, block_bytes
        self.blocks = BlockAllocator(1, num_blocks, (layers[0],))

    @property
    def refcount(self) -> np.ndarray:
        """Holders per ring block, (num_blocks,)."""
        rc: np.ndarray = self.blocks.rc[0]
        return rc

    @property
    def free(self) -> np.ndarray:
        """The free ring blocks' ids."""
        return np.flatnonzero(self.blocks.rc[0] == 0)

    @property
    def multi(self) -> int:
        """Ring blocks held more than once."""
        return int(self.blocks.held_per_unit(2)[0])


class WindowRings:
    """The ring pools (``pools[layer]``: (ring blocks, rb, width)) and ring groups of one cache.

    The ring layers and their widths (values per token) are the config's ``cache_layout(config).rings``;
    ``split``: the first layer of the second group (None: one group); ``num_blocks``: ring blocks per group
    (default ``max_seqs`` whole rings). A restore may recompute some groups only on a causal encoder-decoder
    (its rings split at its pivot)."""

    def __init__(
        self,
        config: ModelConfig,
        block_size: int,
        max_seq_len: int,
        max_seqs: int,
        num_blocks: int | None,
        split: int | None,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        layout = cache_layout(config)
        widths, window, num_layers = layout.rings, layout.window, config.num_layers
        self.window = window
        self.num_layers, self.splittable = num_layers, config.is_ced
        self.ring_len, self.ring_block, self.blocks_per_seq = ring_shape(window if widths else None, block_size, max_seq_len)
        rb, nrb = self.ring_block, self.blocks_per_seq
        ring_layers = sorted(widths)
        check_int(
            "ring_split", split, low=0, high=num_layers, optional=True, accepted=f"a layer index in [0, {num_layers}] or None"
        )
        parts = (
            [[layer for layer in ring_layers if layer < split], [layer for layer in ring_layers if layer >= split]]
            if split is not None
            else [ring_layers]
        )
        parts = [p for p in parts if p]
        if num_blocks is None:
            num_blocks = max_seqs * nrb
        if nrb:
            check_int("ring_blocks", num_blocks, low=nrb, accepted=f"an integer >= one sequence's ring ({nrb} blocks)")
        self.split = split if len(parts) > 1 else None
        itemsize = torch.empty((), dtype=dtype).element_size()
        self.groups = [RingGroup(tuple(p), num_blocks, itemsize * rb * sum(widths[x] for x in p)) for p in parts] if nrb else []
        self.group_of = {layer: i for i, g in enumerate(self.groups) for layer in g.layers}
        self.pools = {layer: lazy_zeros((num_blocks, rb, w), dtype, device) for layer, w in widths.items()} if nrb else {}

    # ---- tables ----------------------------------------------------------------------------------
    def new_tables(self) -> list[list[int]]:
        """A new sequence's ring-block tables: one per group, nothing written yet."""
        return [[-1] * self.blocks_per_seq for _ in self.groups]

    def touched(self, start: int, n: int) -> list[int]:
        """Ring-block indices that positions [start, start + n) write (their last ring_len positions)."""
        W = self.window
        if not self.ring_len or n <= 0 or W is None:
            return []
        if n >= self.ring_len:
            return list(range(self.blocks_per_seq))
        return sorted({(p % W) // self.ring_block for p in range(start + n - min(n, self.ring_len), start + n)})

    def needed(self, tables: list[list[int]], start: int, n: int, groups: Collection[int] | None = None) -> dict[int, int]:
        """Per group (of ``groups``, default all), free ring blocks that writing positions [start, start + n)
        into ``tables`` takes (blocks never written plus copies of shared ones)."""
        touched = self.touched(start, n)
        out = {}
        for gi, g in enumerate(self.groups):
            if groups is not None and gi not in groups:
                continue
            table, rc = tables[gi], g.refcount
            out[gi] = sum(1 for k in touched if table[k] < 0 or rc[table[k]] > 1)
        return out

    def shortfall(self, need: dict[int, int]) -> int | None:
        """The first group with fewer free ring blocks than ``need`` asks for; None when all fit."""
        return next((gi for gi, k in need.items() if k > self.groups[gi].blocks.free_count), None)

    def reserve(self, tables: list[list[int]], need: dict[int, int], start: int, n: int) -> None:
        """Make the ring blocks of ``tables`` that positions [start, start + n) write private (allocate blocks
        never written, copy shared ones first), in the groups of ``need`` (from :meth:`needed`, checked)."""
        for gi in need:
            if not need[gi]:
                continue
            g, table = self.groups[gi], tables[gi]
            for k in self.touched(start, n):
                old = table[k]
                if old >= 0 and g.refcount[old] == 1:
                    continue
                new = g.blocks.allocate()
                if old >= 0:  # copy on write
                    for layer in g.layers:
                        self.pools[layer][new] = self.pools[layer][old]
                    g.blocks.release(0, 1, [old])
                table[k] = new

    def hold(self, tables: Sequence[Sequence[int]], only: int | None = None) -> None:
        """Hold every written block of ``tables`` once more (per group; ``only``: all are that group's)."""
        for gi, table in enumerate(tables):
            self.groups[gi if only is None else only].blocks.hold(0, 1, [b for b in table if b >= 0])

    def release(self, tables: Sequence[Sequence[int]]) -> None:
        """Let go of every written block of ``tables`` (one table per group)."""
        for gi, table in enumerate(tables):
            self.groups[gi].blocks.release(0, 1, [b for b in table if b >= 0])

    # ---- restore ---------------------------------------------------------------------------------
    def fresh_groups(self, recompute_from: int | None) -> set[int]:
        """The groups a restore with ``recompute_from`` gives fresh ring blocks (those from that layer on)."""
        if recompute_from is None:
            return set()
        check_int("recompute_from", recompute_from, accepted="a layer index or None")
        if self.groups and not self.splittable and recompute_from < self.num_layers:
            raise ConfigError(
                f"recompute_from={recompute_from}: this model's window rings are one group (only a "
                "causal encoder-decoder's rings split at its pivot)"
            )
        fresh = set()
        for gi, g in enumerate(self.groups):
            if g.layers[0] >= recompute_from:
                fresh.add(gi)
            elif g.layers[-1] >= recompute_from:
                raise ConfigError(
                    f"recompute_from={recompute_from} splits ring group {list(g.layers)}; ring groups "
                    f"start at layers {[x.layers[0] for x in self.groups]}"
                )
        return fresh

    def restore_blocks(self, length: int, recompute_from: int | None) -> dict[int, int]:
        """Fresh ring blocks per group that restoring a snapshot of ``length`` tokens with ``recompute_from``
        takes."""
        n = -(-min(length, self.ring_len) // self.ring_block) if self.ring_len else 0
        return {gi: n for gi in self.fresh_groups(recompute_from)}

    def restore(self, tables: list[list[int]], snap_tables: Sequence[Sequence[int]], need: dict[int, int]) -> None:
        """Fill a new sequence's ``tables`` from a snapshot's: fresh blocks in the groups of ``need`` (from
        :meth:`restore_blocks`, checked), the snapshot's blocks shared in the others."""
        for gi, table in enumerate(snap_tables):
            if gi in need:
                for k in range(need[gi]):
                    tables[gi][k] = self.groups[gi].blocks.allocate()
            else:
                tables[gi] = list(table)
                self.hold([table], gi)

    # ---- reading and accounting ------------------------------------------------------------------
    def ring(self, table: list[int], layer: int) -> torch.Tensor:
        """A copy of the ring of ``layer`` held by ``table``, (ring_len, width) by ring slot (zeros where
        never written)."""
        pool = self.pools[layer]
        out = torch.zeros(len(table), *pool.shape[1:], dtype=pool.dtype, device=pool.device)
        for k, b in enumerate(table):
            if b >= 0:
                out[k] = pool[b]
        return out.reshape(-1, pool.shape[-1])

    @property
    def used_bytes(self) -> int:
        """Bytes of ring blocks held by some sequence or snapshot."""
        return sum((g.num_blocks - g.blocks.free_count) * g.block_bytes for g in self.groups)

    @property
    def shared_bytes(self) -> int:
        """Bytes of ring blocks held more than once, each counted once."""
        return sum(g.multi * g.block_bytes for g in self.groups)
