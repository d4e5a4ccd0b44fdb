"""What one forward step needs to know about its rows: the batch context.

A forward runs over *rows*. Without a cache (training, scoring) the rows are the (B, T) batch itself:
:class:`DenseContext`. With the paged cache (:class:`BatchContext`) the rows are sequences of the cache,
each adding its own number of new tokens at its own position, packed on one token axis (1, N): some
rows prefill a chunk, others decode one token, all in one call. Rows adding the same number of tokens
form a *group*; attention runs once per group, with per-row masks built from positions, so rows at
different lengths never see each other's keys or padding. The cache plans a step's rows, groups and reads
(:mod:`kvgraft.model.plan`); :class:`BatchContext` holds that plan and the forward's scratch, and reads
each group's paged pools the way its one tagged field says (``Group.read``: run, home, pieces, gather).

Both contexts offer the same three storage operations to the layers, so a layer has one code path:
``kv`` (store this layer's new key/value entries, return a typed view of every entry its queries may
read: :mod:`kvgraft.model.views`, whose class the context picks from the layer's storage and the group),
``compress`` (a kv_source layer's compressor writes the shared segment) and ``segment`` (read a shared
segment). Cross-layer sharing is the ``layer -> source`` map in the config: a reader
names its source layer and gets what the source stored in this step.

Shapes: G rows of a group, T new tokens per row, S keys, W a window, E an entry's width.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch

from kvgraft.model import cpu_kernels
from kvgraft.model.cache import PagedKVCache
from kvgraft.model.plan import (
    MAX_ROW_PIECES,
    MIXED,
    ROW_VIEW_MIN_BYTES,
    Group,
    Home,
    Pieces,
    ReadPolicy,
    Run,
    StepPlan,
    plan_step,
)
from kvgraft.model.views import Entries, HeadMajorKV, HomeRows, KVView, RowPieces

__all__ = ["BatchContext", "DenseContext", "EntryWriter", "StepContext", "active_context", "current_context"]

_FAR = -(10**9)  # position of a ring slot never written: outside every window
_local = threading.local()


def current_context() -> StepContext | None:
    """The step context of the forward running on this thread (None outside a forward)."""
    return getattr(_local, "ctx", None)


@contextmanager
def active_context(ctx: StepContext) -> Iterator[None]:
    """Make ``ctx`` the current context of this thread for the duration of a forward (nestable)."""
    prev = getattr(_local, "ctx", None)
    _local.ctx = ctx
    try:
        yield
    finally:
        _local.ctx = prev


class EntryWriter(Protocol):
    """What a kv_source layer's compressor offers the step context (``kvgraft.model.ced.Compressor``)."""

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor: ...

    def token_entries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor: ...

    def gate_scores(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor: ...

    def pool(self, entries: torch.Tensor, scores: torch.Tensor | None) -> torch.Tensor: ...


class StepContext:
    """What the layers of one forward read and write (see the module docstring): the base of
    :class:`DenseContext` and :class:`BatchContext`."""

    groups: list[Group]
    scratch: dict[object, Any]
    cache: PagedKVCache | None
    adapter_ids: list[object]  # per row: its adapter (None: the base model)
    new_tokens: list[int]  # per row: tokens it adds in this step
    default_positions: bool = False  # cache-free rows at positions 0..T-1: plain causal masks suffice
    active_group: int | None = None  # the group a layer is processing (inside each_group), else None
    active_adapter: object = MIXED  # inside ``each_adapter``: the adapter of the rows being processed
    has_adapters: bool = False  # some row names an adapter

    def each_group(self) -> Iterator[tuple[int, Group]]:
        """``enumerate(self.groups)``, marking each as the active group while the caller processes it
        (modules applied to a group's tensors, e.g. adapter layers, read ``active_group``)."""
        try:
            for gi, g in enumerate(self.groups):
                self.active_group = gi
                yield gi, g
        finally:
            self.active_group = None

    def each_adapter(self, gi: int) -> Iterator[tuple[object, torch.Tensor | None]]:
        """Split group ``gi`` by adapter for code that reads weights through the one door
        (``kvgraft.model.latent.linear_weight``): yields (adapter, row indices within the group), or once
        (adapter, None) for a group of one adapter; while each is processed, adapter layers apply that
        adapter to the sub-batch they are given."""
        g = self.groups[gi]
        if g.adapter is not MIXED:
            yield g.adapter, None
            return
        try:
            for adapter, rows in g.adapter_rows:
                self.active_adapter = adapter
                yield adapter, rows
        finally:
            self.active_adapter = MIXED

    def adapter_tokens(self) -> dict[object, torch.Tensor]:
        """Adapter -> indices of its rows' tokens on the packed token axis (adapters only, not the base)."""
        return {}

    @contextmanager
    def base_weights(self) -> Iterator[None]:
        """Within: adapter layers act as the base (the door returns base weights), e.g. while a caller
        adds per-row adapter deltas itself."""
        prev = self.active_adapter
        self.active_adapter = None
        try:
            yield
        finally:
            self.active_adapter = prev

    def row_adapters(self, gi: int) -> list[object]:
        """The adapter of each row of group ``gi``, in the group's row order."""
        return [self.adapter_ids[r] for r in self.groups[gi].rows]

    def kv(self, layer: int, gi: int, entries: torch.Tensor | None) -> KVView:
        """Writer (``entries`` (G, T, E)): store the new entries of ``layer``; reader (None): fetch what
        the writer ``layer`` stored this step. The typed view of every entry group ``gi`` may read."""
        raise NotImplementedError

    def attend_rows(
        self, layer: int, q: torch.Tensor, entries: torch.Tensor | None, window: int | None, scale: float
    ) -> torch.Tensor | None:
        """Every row of the step at once (GQA layers): store ``layer``'s new entries ((1, N, 2 K d), None for a
        reader of ``layer``'s slot) and attend the step's queries ``q`` (N, H, d) over each row's keys; (1, N, H d)
        token-major, or None where this does not apply (the caller then goes group by group)."""
        return None

    def ring_decode_applies(self, layer: int, gi: int, source: int | None, widths: tuple[int, int, int | None, int]) -> bool:
        """Whether :meth:`ring_decode` runs group ``gi`` of window-ring ``layer`` (reading ``source``'s shared
        entries, None: none) with widths (K, dk, d_c + d_rope or None, d_c)."""
        return False

    def ring_decode(
        self,
        layer: int,
        gi: int,
        entries: torch.Tensor,
        q: torch.Tensor,
        q_lat: torch.Tensor | None,
        bias: torch.Tensor | None,
        source: int | None,
        widths: tuple[int, int, int | None, int],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Decode rows of a causal encoder-decoder layer in one call: store ``entries`` (G, 1, E) in the rows' window
        rings, attend the absorbed queries (``q`` (G, H, dk), ``q_lat`` (G, H, d_c + d_rope) or None, ``bias``
        (G, H) or None) over each row's ring and ``source``'s shared entries it sees, under one softmax: (window
        values (G, H, dv), latent sums (G, H, d_c), mass on the latents (G, H)). Only where
        :meth:`ring_decode_applies`."""
        raise NotImplementedError

    def compress(
        self, layer: int, gi: int, compressor: EntryWriter, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> None:
        """kv_source ``layer``'s compressor writes the shared entries of the group's new tokens (G, T, h)."""
        raise NotImplementedError

    def segment(self, source: int, gi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The shared entries of ``source`` group ``gi`` may read (G, N, E), with each entry's first token
        position (G, N)."""
        raise NotImplementedError

    def token_adapters(self) -> list[object]:
        """The adapter of each token on the packed token axis."""
        return [a for a, t in zip(self.adapter_ids, self.new_tokens) for _ in range(t)]

    def window_mask(self, gi: int, kpos: torch.Tensor, window: int | None, key: object) -> torch.Tensor:
        """(G, T, S) bool: query i sees key j iff j <= i and, with a window W, i - j < W."""
        cache_key = ("mask", gi, key, window)
        mask = self.scratch.get(cache_key)
        if mask is None:
            q = self.groups[gi].qpos[:, :, None]
            k = kpos[:, None, :]
            mask = k <= q
            if window is not None:
                mask &= (q - k) < window
            self.scratch[cache_key] = mask
        return mask


class DenseContext(StepContext):
    """Cache-free forward over a (B, T) batch: every row's tokens at ``positions`` (default 0..T-1)."""

    def __init__(self, positions: torch.Tensor, default_positions: bool, compress_rate: int = 1) -> None:
        B, T = positions.shape
        self.compress_rate = compress_rate
        self.groups = [Group(list(range(B)), T, positions)]
        self.default_positions = default_positions  # plain causal masks suffice
        self.scratch = {}
        self.cache = None
        self.adapter_ids, self.new_tokens = [None] * B, [T] * B

    def kv(self, layer: int, gi: int, entries: torch.Tensor | None) -> KVView:
        """Store (writer) or fetch (reader) ``layer``'s entries (B, T, E); returns them with their positions
        (the batch itself: an :class:`~kvgraft.model.views.Entries` view)."""
        if entries is not None:
            self.scratch[("kv", layer)] = entries
        return Entries(self.scratch[("kv", layer)], self.groups[gi].qpos)

    def compress(
        self, layer: int, gi: int, compressor: EntryWriter, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> None:
        self.scratch[("seg", layer)] = compressor(x, cos, sin)

    def segment(self, source: int, gi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The shared entries (B, N, E) of ``source`` and each entry's first token position (B, N)."""
        entries = self.scratch[("seg", source)]
        first = torch.arange(entries.shape[1], device=entries.device) * self.compress_rate
        return entries, first.expand(entries.shape[0], -1)


class BatchContext(StepContext):
    """One forward step over sequences of a :class:`PagedKVCache`.

    ``seqs[r]`` adds ``new_tokens[r]`` tokens (packed in row order on the token axis). Construction is one
    call, :func:`kvgraft.model.plan.plan_step`: the cache reserves their blocks (copy on write included) and returns the
    step's immutable layout (``self.plan``, :class:`kvgraft.model.plan.StepPlan`: groups, tables, positions,
    one read strategy per group); this object holds it with the forward's scratch, answers the layers'
    storage calls from it, and :meth:`commit` records the tokens after the forward.
    ``adapter_ids[r]`` names the row's adapter (None: the base model); rows are grouped by new tokens (and
    by adapter on MLA models), and adapter layers read each row's adapter through :meth:`adapter_tokens`,
    :meth:`row_adapters` or the group. Class attributes choose the reads (:class:`kvgraft.model.plan.ReadPolicy`):
    ``views`` False makes every group gather, ``home`` False gathers rows at home, ``split_lengths`` False
    pads every gathered row of a group to its longest.

    ``replay=True``: the rows' ``new_tokens`` are the *last* tokens each sequence already holds, run again
    through some layers (``Transformer.replay``) to rebuild their window rings, e.g. for another adapter:
    rings are read as empty (the replay's own tokens are the window), shared segments are read and not
    written, nothing is reserved or committed. On full-attention layers a replay runs over all the
    sequence's tokens and ``write_from`` names the first layer whose paged KV it rewrites (into blocks
    the sequence holds alone: ``PagedKVCache.restore(..., recompute_from=)``); layers below read what the
    shared blocks hold. ``replay_at``: each row's first replayed position (default: its last
    ``new_tokens``), so such a replay can run in chunks from position 0. ``capture_layer``: the forward keeps the hidden state
    entering that layer (packed, (1, N, h)) in ``captured``.

    Adapters: ``BatchContext(..., adapter_ids=...)`` names each row's adapter (None: the base). Rows of
    different adapters share a group (``Group.adapter`` is then ``MIXED`` and ``Group.adapter_rows`` says
    which rows use which), so a mixed batch runs every per-group operation once, like a single-adapter
    batch. A module that adds per-row adapter deltas (``kvgraft.runtime.adapters.MultiLoraLinear``) reads the
    step it runs in through :func:`current_context` (the model sets it for the duration of a forward, per
    thread): inside a layer's loop over groups (:meth:`BatchContext.each_group` marks the active group) the
    group's rows and their adapters; outside that loop its input is the packed token axis and
    :meth:`BatchContext.adapter_tokens` gives each adapter's token indices. Code that reads a weight through
    the one door (``kvgraft.model.latent.linear_weight``: latent attention's kv_b, absorbed decode) cannot
    serve rows of different adapters with one matrix, so it runs per adapter of the group
    (:meth:`each_adapter`). MLA layers fold weights per group, so on MLA models groups are also keyed by
    adapter.
    """

    cache: PagedKVCache  # (always a cache: narrows the base class's optional one)
    views = True  # read a single row's consecutive blocks as a view of the pool (False: always gather)
    home = True  # decode rows at home read one strided view of each GQA pool (False: gathered)
    split_lengths = True  # gathered rows at different lengths are cut by length (kvgraft.model.plan.length_split)
    paged = True  # CPU: a GQA layer attends every row in one kernel call through block tables (False: by group)
    whole_layers = True  # with paged: a Llama-family layer runs in one kernel call (cpu_kernels.gqa_layer)
    ring_kernel = True  # CPU: a CED layer's decode rows read ring and latents in one call (cpu_kernels.ced_decode)

    def __init__(
        self,
        cache: PagedKVCache,
        seqs: list[int],
        new_tokens: list[int],
        adapter_ids: list[object] | None = None,
        *,
        replay: bool = False,
        capture_layer: int | None = None,
        write_from: int | None = None,
        replay_at: list[int] | None = None,
    ) -> None:
        # the cache plans the step (reservation, groups, tables, positions, read strategies); the reads it may
        # choose are this class's ``views`` and this module's thresholds (tests and benchmarks set them here)
        policy = ReadPolicy(self.views, ROW_VIEW_MIN_BYTES, MAX_ROW_PIECES, self.home, self.split_lengths, paged=self.paged)
        plan = plan_step(
            cache, seqs, new_tokens, adapter_ids, replay=replay, write_from=write_from, replay_at=replay_at, policy=policy
        )
        self.plan: StepPlan = plan
        self.cache = cache
        self.replay, self.write_from, self.capture_layer = replay, write_from, capture_layer
        self.captured: torch.Tensor | None = None  # the hidden state entering capture_layer, after a forward
        self.seqs, self.new_tokens = list(plan.seqs), list(plan.new_tokens)
        self.starts, self.offsets, self.num_tokens = list(plan.starts), list(plan.offsets), plan.num_tokens
        self.positions, self.last_index = plan.positions, plan.last_index
        self.groups = list(plan.groups)
        self.adapter_ids = list(adapter_ids) if adapter_ids is not None else [None] * len(seqs)
        self.has_adapters = any(a is not None for a in self.adapter_ids)
        self._adapter_tokens: dict[object, torch.Tensor] | None = None
        self.scratch = {"compress_rate": cache.layout.compress_rate}

    def adapter_tokens(self) -> dict[object, torch.Tensor]:
        """Adapter -> indices (on the packed token axis) of the tokens of its rows; the base is left out."""
        if self._adapter_tokens is None:
            by: dict[object, list[int]] = {}
            for r, a in enumerate(self.adapter_ids):
                if a is not None:
                    by.setdefault(a, []).extend(range(self.offsets[r], self.offsets[r] + self.new_tokens[r]))
            dev = self.cache.device
            self._adapter_tokens = {a: torch.tensor(ix, dtype=torch.long, device=dev) for a, ix in by.items()}
        return self._adapter_tokens

    def commit(self) -> None:
        """Record the step's tokens in the cache (the model calls this once every layer ran); a replay
        adds none."""
        if self.replay:
            return
        for s, t in zip(self.seqs, self.new_tokens):
            self.cache.commit(s, t)

    # ---- storage operations -------------------------------------------------------------------
    def kv(self, layer: int, gi: int, entries: torch.Tensor | None) -> KVView:
        """Writer (``entries`` (G, T, E)): store the new entries of ``layer``; reader (None): fetch what
        the writer ``layer`` stored this step. Returns the typed view (:mod:`kvgraft.model.views`) of every
        entry the group's queries may read: a GQA layer's paged keys head-major (:class:`HeadMajorKV`),
        decode rows read as views of the pools (:class:`RowPieces`, when the group was built so), else one
        tensor by key with positions (:class:`Entries`: gathered paged rows, a window ring and the step's
        tokens)."""
        key = ("kv", layer, gi)
        if entries is None:
            stored: KVView = self.scratch[key]
            return stored
        g, c = self.groups[gi], self.cache
        out: KVView
        write = True
        if self.replay and layer not in c.rings:
            if self.write_from is None:
                raise ValueError(
                    f"layer {layer} stores paged KV: a replay over it needs write_from (the first layer "
                    "whose KV it rebuilds; the layers below are read as the cache holds them)"
                )
            write = layer >= self.write_from  # below: the shared blocks already hold exactly these entries
        if layer in c.head_major:  # GQA: (2K, G, S, d), keys then values per head, each head contiguous
            pool = c.paged[layer]
            unit = c.unit_of_paged[layer]
            H2, _, bs, d = pool.shape
            if write:
                src = entries.reshape(-1, H2, d).transpose(0, 1).to(pool.dtype)  # (2K, G*T, d)
                cpu_kernels.index_copy_rows_(pool.view(H2, -1, d), self._token_slots(gi, unit), src)
            out = self._read_head_major(pool, g.tables[unit], g, gi)
        elif layer in c.paged:
            pool = c.paged[layer]
            unit = c.unit_of_paged[layer]
            if write:
                pool.view(-1, pool.shape[-1]).index_copy_(
                    0, self._token_slots(gi, unit), entries.reshape(-1, entries.shape[-1]).to(pool.dtype)
                )
            out = self._read_rows(pool, g.tables[unit], g, gi)
        else:  # a ring of the last W tokens: [ring as it was ; new tokens], then the ring is updated
            ring_pool = c.rings[layer]  # (ring blocks, rb, E)
            W, R, rb = c.window_rings.window, c.ring_len, c.ring_block
            if W is None:
                raise ValueError(f"layer {layer} has a ring but the cache no window")
            rg = c.ring_group_of[layer]
            rtab = g.rings[rg]  # (G, R / rb)
            # decode (one new token a row): write the token into its ring slot first, then one gather reads the
            # ring's R slots and that slot again as the (R+1)-th key: the slot's own place in the ring keeps the
            # position it held (p - W, outside the window: masked), so the keys, their positions and the math
            # are those of [ring as it was ; new token], without the concatenation's second copy
            decode = g.T == 1 and not self.replay
            place = self.scratch.get(("ring", gi, rg))  # the same for every layer of the ring group
            if place is None:
                n = min(g.T, R)
                idx = g.qpos[:, g.T - n :] % W  # (G, n) ring slots
                flat = rtab.gather(1, idx // rb) * rb + idx % rb  # (G, n)
                last = (g.paged_rows()[0] - 1)[:, None]  # the latest position the ring holds
                slot = torch.arange(R, device=rtab.device)[None]
                ring_pos = last - torch.remainder(last - slot, W)
                ring_pos = torch.where((ring_pos >= 0) & (not self.replay), ring_pos, torch.full_like(ring_pos, _FAR))
                read = torch.cat([rtab.gather(1, slot.expand(g.G, -1) // rb) * rb + slot % rb, flat], 1) if decode else None
                place = self.scratch[("ring", gi, rg)] = (n, flat.reshape(-1), torch.cat([ring_pos, g.qpos], dim=1), read)
            n, flat, kpos, read = place
            new = entries[:, g.T - n :].reshape(-1, entries.shape[-1]).to(ring_pool.dtype)
            rows = ring_pool.view(-1, ring_pool.shape[-1])
            if read is not None:
                rows.index_copy_(0, flat, new)
                keys = rows.index_select(0, read.reshape(-1)).view(g.G, R + 1, -1)
            else:
                ring = ring_pool.index_select(0, rtab.reshape(-1)).view(g.G, R, -1)  # (G, R, E) copy, by ring slot
                keys = torch.cat([ring, entries.to(ring.dtype)], dim=1)
                rows.index_copy_(0, flat, new)
            out = Entries(keys, kpos)
        self.scratch[key] = out
        return out

    def attend_rows(
        self, layer: int, q: torch.Tensor, entries: torch.Tensor | None, window: int | None, scale: float
    ) -> torch.Tensor | None:
        """One call for every row of the step over a GQA layer's pool (the plan's ``rows`` and ``row_tables``;
        CPU kernel :func:`kvgraft.model.cpu_kernels.paged_attention`): the new entries written with one row copy,
        each row's keys read through its block table, no gather, mask or per-group copy. None where it does not
        apply: no step rows planned, not a GQA pool, or the kernel declines the queries."""
        plan, c = self.plan, self.cache
        if plan.rows is None or layer not in c.head_major or not cpu_kernels.paged_attention_applies(q, c.paged[layer]):
            return None
        table, write = self._rows_of(layer)
        pool = c.paged[layer]
        H2, _, _, d = pool.shape
        N = plan.num_tokens
        if entries is not None and write:
            rows = entries.reshape(N, H2, d).transpose(0, 1)
            cpu_kernels.index_copy_rows_(pool.view(H2, -1, d), self._row_slots(table), rows)
        y = cpu_kernels.paged_attention(q, pool, table, plan.rows, window, scale)
        return None if y is None else y.view(1, N, -1)

    def ring_decode_applies(self, layer: int, gi: int, source: int | None, widths: tuple[int, int, int | None, int]) -> bool:
        g, c = self.groups[gi], self.cache
        if not self.ring_kernel or g.T != 1 or self.replay or layer not in c.rings or torch.is_grad_enabled():
            return False
        seg = None if source is None else c.segments[source]
        return cpu_kernels.ced_decode_applies(c.rings[layer], seg, *widths)

    def ring_decode(
        self,
        layer: int,
        gi: int,
        entries: torch.Tensor,
        q: torch.Tensor,
        q_lat: torch.Tensor | None,
        bias: torch.Tensor | None,
        source: int | None,
        widths: tuple[int, int, int | None, int],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        g, c = self.groups[gi], self.cache
        rg = c.ring_group_of[layer]
        rtab = g.rings[rg]  # (G, R / rb)
        key = ("ring decode", gi, rg, source is None)  # the same for every layer of the ring group
        place = self.scratch.get(key)
        if place is None:
            W, R, rb = c.window_rings.window, c.ring_len, c.ring_block
            assert W is not None  # (a layer with a ring)
            p = g.qpos[:, 0]  # each row's new token: it goes to ring slot p % W, over position p - W
            slot = p % W
            flat = rtab.gather(1, (slot // rb)[:, None])[:, 0] * rb + slot % rb
            seen = torch.clamp(p + 1, max=R)  # the ring then holds positions (p - W, p]: slots [0, min(p + 1, R))
            if source is None:
                shared = torch.zeros_like(p)
            else:  # entry n (first token n m) once that token left the window: n m <= p - W (kvgraft.model.ced)
                m = c.layout.compress_rate
                shared = torch.minimum(torch.div(p - W, m, rounding_mode="floor") + 1, (p + 1) // m).clamp(min=0)
            place = self.scratch[key] = (flat, torch.stack([seen, shared], dim=1))
        flat, counts = place
        ring = c.rings[layer]
        ring.view(-1, ring.shape[-1]).index_copy_(0, flat, entries.reshape(-1, entries.shape[-1]).to(ring.dtype))
        seg = stab = None
        if source is not None:
            seg, stab = c.segments[source], g.tables[c.unit_of_segment[source]]
        K, _, _, dc = widths
        got = cpu_kernels.ced_decode(q, q_lat, bias, ring, rtab, seg, stab, counts, K, dc)
        if got is None:
            raise RuntimeError(f"layer {layer}: ced_decode declined what ring_decode_applies accepted")
        return got

    def layer_step(self, layer: int, cos: torch.Tensor, sin: torch.Tensor) -> tuple[list[torch.Tensor], bool] | None:
        """What a GQA layer's one-call form (:func:`kvgraft.model.cpu_kernels.gqa_layer`) reads of the step:
        ([cos, sin, the layer's pool, each new token's pool row, the rows' block tables, the rows], whether the
        layer writes its new entries), or None where the step is not planned for one call over its rows."""
        plan, c = self.plan, self.cache
        if plan.rows is None or layer not in c.head_major or not self.whole_layers:
            return None
        table, write = self._rows_of(layer)
        return [cos, sin, c.paged[layer], self._row_slots(table), table, plan.rows], write

    def _rows_of(self, layer: int) -> tuple[torch.Tensor, bool]:
        """(the step rows' block tables of GQA ``layer``'s unit, whether the step writes its new entries there): a
        replay writes from ``write_from`` on (below it the shared blocks already hold exactly these entries)."""
        write = True
        if self.replay:
            if self.write_from is None:
                raise ValueError(
                    f"layer {layer} stores paged KV: a replay over it needs write_from (the first layer "
                    "whose KV it rebuilds; the layers below are read as the cache holds them)"
                )
            write = layer >= self.write_from
        return self.plan.row_tables[self.cache.unit_of_paged[layer]], write

    def _row_slots(self, table: torch.Tensor) -> torch.Tensor:
        """(N,) the pool row (block id x block size + offset) of every new token of the step, for the rows' tables
        ``table``; once a step per table."""
        key = ("slots", "rows", id(table))  # the plan holds its tables for the step: ids are not reused meanwhile
        flat: torch.Tensor | None = self.scratch.get(key)
        if flat is None:
            plan, bs = self.plan, self.cache.block_size
            pos = plan.positions[0]
            assert plan.rows is not None
            row = torch.repeat_interleave(torch.arange(len(plan.seqs)), plan.rows[:, 1], output_size=plan.num_tokens)
            flat = self.scratch[key] = table[row, pos // bs] * bs + pos % bs
        return flat

    def _token_slots(self, gi: int, unit: int) -> torch.Tensor:
        """(G T,) the pool rows (block id x block size + offset) of group ``gi``'s new tokens in ``unit``'s
        blocks; the same for every unit reading one table (all of them, unless a restore split a row's layers
        into spans), so worked out once a step per table."""
        g = self.groups[gi]
        table = g.tables[unit]
        key = ("slots", gi, id(table))  # the plan holds its tables for the step: ids are not reused meanwhile
        flat: torch.Tensor | None = self.scratch.get(key)
        if flat is None:
            bs = self.cache.block_size
            flat = self.scratch[key] = (table.gather(1, g.qpos // bs) * bs + g.qpos % bs).reshape(-1)
        return flat

    def _key_positions(self, gi: int) -> torch.Tensor:
        """(G, S) the positions 0..S-1 of group ``gi``'s paged keys (S: the longest row's end), once a step."""
        key = ("kpos", gi)
        kpos: torch.Tensor | None = self.scratch.get(key)
        if kpos is None:
            g = self.groups[gi]
            kpos = self.scratch[key] = torch.arange(g.max_end, device=g.qpos.device).expand(g.G, -1)
        return kpos

    def _read_head_major(self, pool: torch.Tensor, table: torch.Tensor, g: Group, gi: int) -> KVView:
        """A GQA pool (2K, blocks, bs, d) read the group's way (``g.read``): (2K, G, S, d) keys then values."""
        H2, _, bs, d = pool.shape
        kpos = self._key_positions(gi)
        match g.read:
            case Home(lo, hi, index):  # rows at home: one strided view of the pool over their slots, no copy
                return HomeRows(self.cache.home_view(pool, lo, hi, g.max_end, dim=1), index, kpos)  # (2K, hi - lo, S, d)
            case Pieces(rows):  # decode rows read as views: per row, its pieces (2K, 1, S_i, d), no copy
                return RowPieces([[pool[:, b : b + n].reshape(H2, 1, n * bs, d)[:, :, :e] for b, n, e in p] for p in rows])
            case Run(first):  # one row in consecutive blocks: a view of the pool
                nb = table.shape[1]
                return HeadMajorKV(pool[:, first : first + nb].reshape(H2, 1, nb * bs, d)[:, :, : g.max_end], kpos)
        # a gather: index_select, not pool[:, table]: the same copy, ~4x faster on the CPU (advanced indexing
        # takes a generic strided path; index_select copies whole (bs, d) blocks)
        return HeadMajorKV(pool.index_select(1, table.reshape(-1)).view(H2, g.G, -1, d)[:, :, : g.max_end], kpos)

    def _read_rows(self, pool: torch.Tensor, table: torch.Tensor, g: Group, gi: int) -> KVView:
        """A paged pool of one row per token (blocks, bs, E) read the group's way: (G, S, E) with positions."""
        bs, E = pool.shape[1], pool.shape[-1]
        read = g.read.rest if isinstance(g.read, Home) else g.read  # home views are for GQA pools only
        match read:
            case Pieces(rows):  # decode rows read as views: per row, its pieces (S_i, E)
                return RowPieces([[pool[b : b + n].reshape(n * bs, E)[:e] for b, n, e in p] for p in rows])
            case Run(first):
                keys = pool[first : first + table.shape[1]].reshape(1, -1, E)[:, : g.max_end]
            case _:
                keys = pool.index_select(0, table.reshape(-1)).view(g.G, -1, E)[:, : g.max_end]
        return Entries(keys, self._key_positions(gi))

    def compress(
        self, layer: int, gi: int, compressor: EntryWriter, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> None:
        """Run kv_source ``layer``'s compressor on the group's new tokens (G, T, h): store every entry
        they complete in the shared segment, keep the rest as the row's pending tokens."""
        if self.replay:  # the shared segments already hold these tokens (a replay recomputes windows only)
            return
        g, c = self.groups[gi], self.cache
        m = c.layout.compress_rate
        seg = c.segments[layer]
        table = g.tables[c.unit_of_segment[layer]]
        epb = seg.shape[1]  # entries per block
        entries = compressor.token_entries(x, cos, sin)  # (G, T, E)
        E = entries.shape[-1]
        if m == 1:
            pos = g.qpos
            flat = table.gather(1, pos // epb) * epb + pos % epb
            seg.view(-1, E).index_copy_(0, flat.reshape(-1), entries.reshape(-1, E).to(seg.dtype))
            return
        scores = compressor.gate_scores(x, g.qpos)  # (G, T, D)
        starts, row_slots = g.paged_rows()
        phase = starts % m
        pend = c.pending[layer]
        for p in sorted(set(phase.tolist())):
            sub = (phase == p).nonzero().squeeze(1)
            slots = row_slots[sub]
            held = pend.index_select(0, slots)  # (Gs, m - 1, E + D)
            all_e = torch.cat([held[:, :p, :E].to(entries.dtype), entries[sub]], dim=1)
            all_s = torch.cat([held[:, :p, E:].to(scores.dtype), scores[sub]], dim=1)
            n = all_e.shape[1] // m * m
            rest = all_e.shape[1] - n
            if rest:
                pend[slots[:, None], torch.arange(rest, device=pend.device)[None]] = torch.cat(
                    [all_e[:, n:], all_s[:, n:]], dim=-1
                ).to(pend.dtype)
            if n:
                blocks = compressor.pool(all_e[:, :n], all_s[:, :n])  # (Gs, n / m, E)
                e = (starts[sub] // m)[:, None] + torch.arange(n // m, device=blocks.device)[None]
                flat = table[sub].gather(1, e // epb) * epb + e % epb
                seg.view(-1, E).index_copy_(0, flat.reshape(-1), blocks.reshape(-1, E).to(seg.dtype))

    def segment(self, source: int, gi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The shared entries of ``source`` visible after this step (G, N, E), with each entry's first
        token position (G, N); entries past a row's end are never visible (see kvgraft.model.ced)."""
        key = ("seg", source, gi)
        if key not in self.scratch:
            g, c = self.groups[gi], self.cache
            m = c.layout.compress_rate
            seg = c.segments[source]
            table = g.tables[c.unit_of_segment[source]]
            N = g.max_end // m
            if isinstance(g.read, Run):
                entries = seg[g.read.first : g.read.first + table.shape[1]].reshape(1, -1, seg.shape[-1])[:, :N]
            else:
                entries = seg.index_select(0, table.reshape(-1)).view(g.G, -1, seg.shape[-1])[:, :N]
            first = (torch.arange(N, device=entries.device) * m).expand(g.G, -1)
            self.scratch[key] = (entries, first)
        seg_entries: tuple[torch.Tensor, torch.Tensor] = self.scratch[key]
        return seg_entries
