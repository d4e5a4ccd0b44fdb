"""The block allocator: reference-counted block ids shared by several pools.

Every paged store of the KV cache hands out memory through this one class: the token blocks of the paged
layers and shared segments (:class:`kvgraft.model.cache.PagedKVCache`) and the ring blocks of each ring
group (:class:`kvgraft.model.rings.WindowRings`).

An allocator has ``num_blocks`` ids and ``num_units`` *units* (pools indexed by the same ids: one per
paged layer or segment; one for a ring group, whose layers share one table). Id ``b`` is held per unit
with a reference count, so several owners (sequences, snapshots) may hold the same block, and a sequence
whose layers were split into spans (a restore that recomputes some layers) holds different ids in
different units. An id is *free* when no unit holds it; free ids are handed out oldest freed first.

Contiguity: a sequence that says how long it will get claims a run of free ids at its first block and
grows into it (:meth:`allocate_next`), so its blocks stay consecutive and decode reads them as views of
the pools. A claim is a preference, not a reservation: claimed ids count as free, and other owners take
them only when no unclaimed id is left. Capacity errors are :class:`CacheFullError`.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable

import numpy as np
import torch


class CacheFullError(RuntimeError):
    """Not enough free blocks or sequence slots; the engine preempts, direct callers allocate more."""


class BlockAllocator:
    """``num_blocks`` reference-counted ids over ``num_units`` pools (see the module docstring)."""

    def __init__(self, num_units: int, num_blocks: int, unit_labels: tuple[object, ...] | None = None) -> None:
        self.num_units, self.num_blocks = num_units, num_blocks
        self.unit_labels = unit_labels if unit_labels is not None else tuple(range(num_units))  # for messages
        self.rc = np.zeros((num_units, num_blocks), dtype=np.int32)  # holders per (unit, id)
        self._free_units = np.full(num_blocks, num_units, dtype=np.int32)  # units in which an id is free
        self._free_q: deque[int] = deque(range(num_blocks))  # ids free in every unit (stale entries skipped)
        self._claim = np.full(num_blocks, -1, dtype=np.int64)  # claiming owner of a free id, -1: none

    # ---- reading -----------------------------------------------------------------------------------
    def refcount(self, block: int, unit: int = 0) -> int:
        return int(self.rc[unit, block])

    @property
    def free_count(self) -> int:
        """Ids free in every unit."""
        return int(np.count_nonzero(self._free_units == self.num_units))

    def available(self, lo: int, hi: int) -> int:
        """Ids free in every unit of [lo, hi)."""
        if lo == 0 and hi == self.num_units:
            return self.free_count
        return int(np.count_nonzero((self.rc[lo:hi] == 0).all(0)))

    def shared(self, lo: int, hi: int, block: int) -> bool:
        """Whether some unit of [lo, hi) holds ``block`` more than once."""
        return bool((self.rc[lo:hi, block] > 1).any())

    def held_per_unit(self, times: int = 1) -> np.ndarray:
        """Per unit, the ids held more than ``times - 1`` times ((num_units,) int)."""
        held: np.ndarray = (self.rc >= times).sum(1)
        return held

    # ---- allocation --------------------------------------------------------------------------------
    def allocate(self, lo: int = 0, hi: int | None = None) -> int:
        """An id free in units [lo, hi), now held once there. All units: the oldest fully free id, unclaimed
        ones first; a span: preferably an id some other span already holds (keeping fully free ids whole)."""
        U = self.num_units
        hi = U if hi is None else hi
        if lo == 0 and hi == U:
            claimed: list[int] = []  # free ids claimed by a growing owner: taken only when nothing else is free
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
            free = (self.rc[lo:hi] == 0).all(0)
            idx = np.flatnonzero(free & (self._free_units < U))
            if not idx.size:
                idx = np.flatnonzero(free)
            if not idx.size:
                raise CacheFullError(f"no block free in layers {self.unit_labels[lo]}..{self.unit_labels[hi - 1]}")
            b = int(idx[0])
        self.rc[lo:hi, b] = 1
        self._free_units[b] -= hi - lo
        return b

    def allocate_next(self, owner: int, table: list[int], expect_blocks: int, home: int | None = None) -> int:
        """The next id of ``owner``'s (all-unit) ``table``: the id after its last one when free and not
        claimed by another owner; for its first id, ``home`` when the run of ``expect_blocks`` ids from there
        is free and unclaimed, else the start of the first such run (the rest of the run claimed for
        ``owner``); else any id, unclaimed ones first."""
        U = self.num_units
        if table:
            b = table[-1] + 1
            if b < self.num_blocks and self._free_units[b] == U and self._claim[b] in (-1, owner):
                return self._take(b)
        else:
            free = (self._free_units == U) & (self._claim < 0)
            n = min(expect_blocks, self.num_blocks)
            if home is not None and 0 <= home and home + max(n, 1) <= self.num_blocks and free[home : home + max(n, 1)].all():
                self._claim[home + 1 : home + n] = owner
                return self._take(home)
            if n > 1:
                # run starts: free ids with n free ids from there (a sliding window sum over the free mask)
                c = np.concatenate([[0], np.cumsum(free, dtype=np.int64)])
                starts = np.flatnonzero(c[n:] - c[:-n] == n)
                if starts.size:
                    b = int(starts[0])
                    self._claim[b + 1 : b + n] = owner
                    return self._take(b)
        return self.allocate()

    def take_outside(self, lo: int, hi: int, stride: int) -> int | None:
        """A free unclaimed id outside [lo, hi), now held in every unit: the one furthest into its run of
        ``stride`` ids (a slot's home run: the end of a run is the last a sequence grows into); None if none."""
        free = (self._free_units == self.num_units) & (self._claim < 0)
        free[lo:hi] = False
        idx = np.flatnonzero(free)
        if not idx.size:
            return None
        return self._take(int(idx[np.argmax(idx % stride)]) if stride else int(idx[0]))

    def _take(self, b: int) -> int:
        """Hold free id ``b`` in every unit (its stale entry in the free queue is skipped later)."""
        self.rc[:, b] = 1
        self._free_units[b] = 0
        self._claim[b] = -1
        return b

    def unclaim(self, owner: int) -> None:
        """Drop ``owner``'s claims on free ids."""
        self._claim[self._claim == owner] = -1

    def hold(self, lo: int, hi: int, ids: Iterable[int]) -> None:
        """Hold ``ids`` (already held) once more in units [lo, hi)."""
        ix = np.asarray(list(ids), dtype=np.int64)
        if ix.size:
            self.rc[lo:hi, ix] += 1

    def release(self, lo: int, hi: int, ids: Iterable[int]) -> None:
        """Let go of ``ids`` once in units [lo, hi); an id no unit holds any more is free again."""
        ix = np.asarray(list(ids), dtype=np.int64)
        if not ix.size:
            return
        self.rc[lo:hi, ix] -= 1
        self._free_units[ix] += (self.rc[lo:hi, ix] == 0).sum(0).astype(np.int32)
        U = self.num_units
        for b in ix[self._free_units[ix] == U].tolist():
            self._free_q.append(b)
        if len(self._free_q) > 2 * self.num_blocks:  # ids taken outside the queue left stale entries: compact
            self._free_q = deque(np.flatnonzero(self._free_units == U).tolist())


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``torch.zeros(shape)``; on the CPU from ``calloc``'d memory (numpy's zeros), whose pages the OS maps on
    first write, so a pool sized for a memory budget takes resident memory as its blocks are written, not all
    at construction (``torch.zeros`` writes every byte: a 4 GiB pool measured 3.75 GiB more peak RSS at once).
    Elsewhere, ``torch.zeros``."""
    n = math.prod(shape)
    if torch.device(device).type != "cpu" or not n:
        return torch.zeros(shape, dtype=dtype, device=device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(n * itemsize, dtype=np.uint8)).view(dtype).view(shape)
