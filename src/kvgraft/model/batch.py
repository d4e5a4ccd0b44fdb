"""What one forward step needs to know about its rows: the batch context.

A forward runs over *rows*. Without a cache (training, scoring) the rows are the (B, T) batch itself:
:class:`DenseContext`. With the paged cache (:class:`BatchContext`) the rows are sequences of the cache,
each adding its own number of new tokens at its own position, packed on one token axis (1, N): some
rows prefill a chunk, others decode one token, all in one call. Rows adding the same number of tokens
form a *group*; attention runs once per group, with per-row masks built from positions, so rows at
different lengths never see each other's keys or padding.

Both contexts offer the same three storage operations to the layers, so a layer has one code path:
``kv`` (store this layer's new key/value entries, return a typed view of every entry its queries may
read: :mod:`kvgraft.model.views`, whose class the context picks from the layer's storage and the group),
``compress`` (a kv_source layer's compressor writes the shared segment) and ``segment`` (read a shared
segment). Cross-layer sharing is the ``layer -> source`` map in the config: a reader
names its source layer and gets what the source stored in this step.

**Adapters.** ``BatchContext(..., adapter_ids=...)`` names each row's adapter (None: the base). Rows of
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
Shapes: G rows of a group, T new tokens per row, S keys, W a window, E an entry's width.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kvgraft.model.attention_ops import DECODE_MAX_NEW_TOKENS
from kvgraft.model.cache import CacheFullError, PagedKVCache
from kvgraft.model.views import Entries, HeadMajorKV, HomeRows, KVView, RowPieces

_FAR = -(10**9)  # position of a ring slot never written: outside every window
_local = threading.local()


class _Mixed:
    def __repr__(self) -> str:
        return "MIXED"


MIXED = _Mixed()  # Group.adapter of a group whose rows use different adapters


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


# A decode row is read as views when its blocks form at most this many consecutive pieces (a row restored
# from the prefix cache: the kept prompt's blocks, then its own), else the batch is gathered.
MAX_ROW_PIECES = 8


def _pieces(table: list[int], tokens: int, block_size: int) -> list[tuple[int, int, int]]:
    """A block table cut into runs of consecutive ids: (first id, blocks, tokens) each, covering ``tokens``."""
    out: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(table) + 1):
        if i == len(table) or table[i] != table[i - 1] + 1:
            n = i - start
            out.append((table[start], n, min(n * block_size, tokens - start * block_size)))
            start = i
    return out


# Per-row views replace the batch gather from this many bytes of keys + values per row and layer (CPU): measured
# crossover on the Llama reference between 256 tokens (256 kB: the gather still faster) and 1024 (1 MB: views
# 3-4x faster at batch 8), bench/paged_views.py.
ROW_VIEW_MIN_BYTES = 512 * 1024


@dataclass
class Group:
    """Rows attended together: every row adds ``T`` tokens."""

    rows: list[int]
    T: int
    qpos: torch.Tensor  # (G, T) positions of the new tokens
    tok: torch.Tensor | None = None  # (G*T,) indices into the packed token axis; None: the dense batch
    starts: torch.Tensor | None = None  # (G,) tokens each row had cached before this step
    table: torch.Tensor | None = None  # (G, blocks) block tables of the first unit, padded with block 0 (masked)
    slots: torch.Tensor | None = None  # (G,) state slots
    max_end: int = 0  # max over rows of start + T
    adapter: object = None  # the adapter of every row of the group (None: the base model), or MIXED
    # MIXED groups: ((adapter, row indices within the group (tensor)), ...)
    adapter_rows: tuple[tuple[object, torch.Tensor], ...] = ()
    run: int | None = None  # one row whose blocks are consecutive (first block id): read as a view, no copy
    # per ring group: (G, ring blocks) ring-block tables (never-written blocks read as block 0)
    rings: tuple[torch.Tensor, ...] = ()
    # per unit (paged layer or segment: cache.unit_of_*): (G, blocks), shared by units of one span
    tables: tuple[torch.Tensor, ...] = ()
    # decode rows (T = 1) read as views: per row, its cache as a few pieces of consecutive blocks, each
    # (first block id, blocks, tokens); paged layers (GQA, MLA) attend each row over its pieces instead of
    # gathering the batch's blocks
    row_pieces: tuple[list[tuple[int, int, int]], ...] | None = None
    # decode rows whose blocks are their slots' home runs: (first slot, end slot, each row's place in that
    # range or None: the rows are the range in order); GQA layers read the pools as one strided view
    home: tuple[int, int, torch.Tensor | None] | None = None

    def paged_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(starts (G,), state slots (G,)) of a group of cache rows; ValueError for the dense batch."""
        if self.starts is None or self.slots is None:
            raise ValueError("a group of the dense batch holds no cache rows")
        return self.starts, self.slots

    @property
    def G(self) -> int:
        return len(self.rows)

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """(B, N, ...) step tensor -> (G, T, ...) this group's rows."""
        if self.tok is None:
            return t
        return t[0].index_select(0, self.tok).view(self.G, self.T, *t.shape[2:])

    def put(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Write (G, T, ...) ``y`` into the step tensor ``out`` (B, N, ...); returns ``out``."""
        if self.tok is None:
            return y
        out[0].index_copy_(0, self.tok, y.reshape(self.G * self.T, *y.shape[2:]).to(out.dtype))
        return out


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

    ``seqs[r]`` adds ``new_tokens[r]`` tokens (packed in row order on the token axis); construction
    reserves their blocks (copy on write included) and :meth:`commit` records them after the forward.
    ``adapter_ids[r]`` names the row's adapter (None: the base model); rows are grouped by new tokens (and
    by adapter on MLA models), and adapter layers read each row's adapter through :meth:`adapter_tokens`,
    :meth:`row_adapters` or the group. A group of one row whose blocks are consecutive reads its pools as
    views (no copy; ``views``).

    ``replay=True``: the rows' ``new_tokens`` are the *last* tokens each sequence already holds, run again
    through some layers (``Transformer.replay``) to rebuild their window rings, e.g. for another adapter:
    rings are read as empty (the replay's own tokens are the window), shared segments are read and not
    written, nothing is reserved or committed. On full-attention layers a replay runs over all the
    sequence's tokens and ``write_from`` names the first layer whose paged KV it rewrites (into blocks
    the sequence holds alone: ``PagedKVCache.restore(..., recompute_from=)``); layers below read what the
    shared blocks hold. ``replay_at``: each row's first replayed position (default: its last
    ``new_tokens``), so such a replay can run in chunks from position 0. ``capture_layer``: the forward keeps the hidden state
    entering that layer (packed, (1, N, h)) in ``captured``.
    """

    cache: PagedKVCache  # (always a cache: narrows the base class's optional one)
    views = True  # read a single row's consecutive blocks as a view of the pool (False: always gather)

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
        if len(seqs) != len(new_tokens) or not seqs:
            raise ValueError(f"seqs ({len(seqs)}) and new_tokens ({len(new_tokens)}) must be non-empty and of equal length")
        if len(set(seqs)) != len(seqs):
            raise ValueError(f"a sequence appears twice in one step: {seqs}")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 1 for t in new_tokens):
            raise ValueError(f"new_tokens {new_tokens} must be positive integers")
        if adapter_ids is not None and len(adapter_ids) != len(seqs):
            raise ValueError(f"adapter_ids has {len(adapter_ids)} entries for {len(seqs)} rows")
        if replay_at is not None:
            if not replay or write_from is None or len(replay_at) != len(seqs):
                raise ValueError(
                    "replay_at (one first position per row) is for a full-attention replay (replay=True with write_from)"
                )
            for s, t, a in zip(seqs, new_tokens, replay_at):
                if isinstance(a, bool) or not isinstance(a, int) or a < 0 or a + t > cache.length(s):
                    raise ValueError(
                        f"replay of positions [{a}, {a} + {t}) on sequence {s}, which holds {cache.length(s)} tokens"
                    )
        if replay:
            for s, t in zip(seqs, new_tokens):
                if t > cache.length(s):
                    raise ValueError(f"replay of {t} tokens on sequence {s}, which holds {cache.length(s)}")
            # a replay writes the rings of the groups from the cache's ring split on (the decoder): make the
            # ring blocks it writes private (a restore with recompute_from already gave it fresh ones)
            groups = {gi for gi, g in enumerate(cache.ring_groups) if cache.ring_split is None or g.layers[0] >= cache.ring_split}
            for s, t in zip(seqs, new_tokens):
                need = cache.ring_blocks_needed(s, cache.length(s) - t, t, groups)
                if any(k > cache.ring_groups[gi].blocks.free_count for gi, k in need.items()):
                    raise CacheFullError(f"replay of sequence {s} needs ring blocks {need}; not enough free")
            for s, t in zip(seqs, new_tokens):
                cache.reserve_rings(s, cache.length(s) - t, t, groups)
        else:
            for s, t in zip(seqs, new_tokens):
                if not cache.can_extend(s, t):
                    cache.extend(s, t)  # raises the precise error (overflow or no free blocks)
            for s, t in zip(seqs, new_tokens):
                cache.extend(s, t)
        if write_from is not None:
            if not replay:
                raise ValueError("write_from is for a replay (BatchContext(..., replay=True))")
            if isinstance(write_from, bool) or not isinstance(write_from, int) or not 0 <= write_from < cache.config.num_layers:
                raise ValueError(f"write_from ({write_from!r}) must be a layer index in [0, {cache.config.num_layers})")
            cut = next((u for u, (k, x) in enumerate(cache.units) if x >= write_from), len(cache.units))
            for s in seqs:  # the layers it rewrites must hold their own blocks (a restore with recompute_from)
                for u in range(cut, len(cache.units)):
                    if any(cache.refcount(b, u) > 1 for b in cache.block_table(s, u)):
                        raise ValueError(
                            f"replay of sequence {s} would write blocks of layer {cache.units[u][1]} "
                            "that other sequences share; restore it with recompute_from first"
                        )
        self.write_from = write_from
        self.replay, self.capture_layer = replay, capture_layer
        self.captured: torch.Tensor | None = None  # the hidden state entering capture_layer, after a forward
        self.cache, self.seqs, self.new_tokens = cache, list(seqs), list(new_tokens)
        self.adapter_ids = list(adapter_ids) if adapter_ids is not None else [None] * len(seqs)
        self.has_adapters = any(a is not None for a in self.adapter_ids)
        self._adapter_tokens: dict[object, torch.Tensor] | None = None
        self.starts = (
            list(replay_at)
            if replay_at is not None
            else [cache.length(s) - (t if replay else 0) for s, t in zip(seqs, new_tokens)]
        )
        self.scratch = {"compress_rate": cache.layout.compress_rate}
        dev, bs = cache.device, cache.block_size
        offsets: list[int] = []
        n = 0
        for t in new_tokens:
            offsets.append(n)
            n += t
        self.num_tokens = n
        self.offsets = offsets
        self.positions = torch.cat([torch.arange(s, s + t) for s, t in zip(self.starts, new_tokens)]).to(dev)[None]
        self.last_index = torch.tensor([o + t - 1 for o, t in zip(offsets, new_tokens)], device=dev)
        # rows by new tokens; MLA's folded decode keeps one fold per weight, so its groups also split by adapter
        split = "mla" in cache.config.attention_kinds
        by_t: dict[tuple[int, object], list[int]] = {}
        for r, t in enumerate(new_tokens):
            by_t.setdefault((t, self.adapter_ids[r] if split else None), []).append(r)
        self.groups = []
        buckets = [(t, part) for (t, _), rows in by_t.items() for part in self._home_split(cache, seqs, rows, t)]
        for t, rows in buckets:
            names = [self.adapter_ids[r] for r in rows]
            adapter: object = names[0]
            adapter_rows: tuple[tuple[object, torch.Tensor], ...] = ()
            if len(set(names)) > 1:
                by_a: dict[object, list[int]] = {}
                for i, name in enumerate(names):
                    by_a.setdefault(name, []).append(i)
                adapter = MIXED
                adapter_rows = tuple((a, torch.tensor(ix, device=dev)) for a, ix in by_a.items())
            starts = [self.starts[r] for r in rows]
            ends = [s + t for s in starts]
            nb = -(-max(ends) // bs)
            cuts = sorted({u for r in rows for u in cache.span_starts(seqs[r])})  # unit spans: one unless split
            by_cut: dict[int, torch.Tensor] = {}
            for u in cuts:
                tables = [cache.block_table(seqs[r], u)[:nb] for r in rows]
                by_cut[u] = torch.tensor([tb + [0] * (nb - len(tb)) for tb in tables], dtype=torch.long, device=dev)
            unit_tables = tuple(by_cut[max(c for c in cuts if c <= u)] for u in range(len(cache.units)))
            table = by_cut[0]
            tb = tables[0]
            run = (
                tb[0]
                if self.views and len(cuts) == 1 and len(rows) == 1 and len(tb) == nb and len(_pieces(tb, nb * bs, bs)) == 1
                else None
            )
            slots = torch.tensor([cache.slot(seqs[r]) for r in rows], device=dev)
            home = self._home(cache, table, slots, ends, t) if run is None and len(cuts) == 1 else None
            row_pieces: list[list[tuple[int, int, int]]] | None = None
            home_all = home is not None and len(cache.head_major) == len(cache.paged)  # every paged layer reads it
            if self.views and t == 1 and not home_all and len(cuts) == 1 and run is None and self._row_views_pay(cache, ends):
                row_pieces = []
                for r, e in zip(rows, ends):
                    pieces = _pieces(cache.block_table(seqs[r])[: -(-e // bs)], e, bs)
                    if not pieces or len(pieces) > MAX_ROW_PIECES:
                        row_pieces = None
                        break
                    row_pieces.append(pieces)
            tok = torch.cat([torch.arange(offsets[r], offsets[r] + t) for r in rows]).to(dev)
            qpos = torch.tensor(starts, device=dev)[:, None] + torch.arange(t, device=dev)[None]
            rings = tuple(
                torch.tensor([[max(b, 0) for b in cache.ring_table(seqs[r], gi)] for r in rows], dtype=torch.long, device=dev)
                for gi in range(len(cache.ring_groups))
            )
            self.groups.append(
                Group(
                    rows,
                    t,
                    qpos,
                    tok,
                    torch.tensor(starts, device=dev),
                    table,
                    slots,
                    max(ends),
                    adapter,
                    adapter_rows,
                    run,
                    rings,
                    unit_tables,
                    None if row_pieces is None else tuple(row_pieces),
                    home,
                )
            )

    def _home_split(self, cache: PagedKVCache, seqs: list[int], rows: list[int], t: int) -> list[list[int]]:
        """Decode rows split into those whose blocks are their slots' home runs and the rest (each part its
        own group: the first reads views of the pools, the rest is gathered); other rows as they are."""
        if not self.views or not cache.head_major or not cache.home_stride or t > DECODE_MAX_NEW_TOKENS or len(rows) < 3:
            return [rows]
        at = cache.at_home([seqs[r] for r in rows])
        parts = [[r for r, a in zip(rows, at) if a], [r for r, a in zip(rows, at) if not a]]
        return [p for p in parts if p] if len(parts[0]) >= 2 else [rows]

    def _home(
        self, cache: PagedKVCache, table: torch.Tensor, slots: torch.Tensor, ends: list[int], t: int
    ) -> tuple[int, int, torch.Tensor | None] | None:
        """``PagedKVCache.home_range`` of a decode group of several rows (None: not read from home)."""
        if not self.views or not cache.head_major or t > DECODE_MAX_NEW_TOKENS or len(ends) < 2:
            return None
        return cache.home_range(table, slots, ends)

    @staticmethod
    def _row_views_pay(cache: PagedKVCache, ends: list[int]) -> bool:
        """Whether decode rows should attend over per-row views of the paged pools (GQA keys/values, MLA
        latents) rather than one gathered copy: on the CPU, once the average row's largest paged layer holds
        ROW_VIEW_MIN_BYTES. Below that the
        gather is cheap and a few small ops per row cost more; above it the gather's copy (and the fresh
        pages the allocator maps for it) dominates the step (bench/paged_views.py). On an accelerator the
        gather is a fast device copy and per-row ops would each launch kernels: always gather there."""
        if not cache.paged or cache.device.type != "cpu":
            return False
        widths = [
            math.prod(cache.head_major[x]) if x in cache.head_major else p.shape[-1] for x, p in cache.paged.items()
        ]  # values per token: 2K x head_dim, or the latent's width
        per_token = max(widths) * torch.empty((), dtype=cache.dtype).element_size()
        return bool(sum(ends) * per_token >= ROW_VIEW_MIN_BYTES * len(ends))

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
            table = g.tables[c.unit_of_paged[layer]]
            H2, _, bs, d = pool.shape
            if write:
                pos = g.qpos
                flat = (table.gather(1, pos // bs) * bs + pos % bs).reshape(-1)
                src = entries.reshape(-1, H2, d).transpose(0, 1).to(pool.dtype)  # (2K, G*T, d)
                pool.view(H2, -1, d).index_copy_(1, flat, src)
            if g.home is not None:  # rows at home: one strided view of the pool over their slots, no copy
                lo, hi, index = g.home
                keys = c.home_view(pool, lo, hi, g.max_end, dim=1)  # (2K, hi - lo, S, d)
                out = HomeRows(keys, index, torch.arange(g.max_end, device=keys.device).expand(g.G, -1))
                self.scratch[key] = out
                return out
            if g.row_pieces is not None:  # decode rows read as views: per row, its pieces (2K, 1, S_i, d), no copy
                out = RowPieces(
                    [[pool[:, b : b + n].reshape(H2, 1, n * bs, d)[:, :, :e] for b, n, e in pieces] for pieces in g.row_pieces]
                )
                self.scratch[key] = out
                return out
            if g.run is not None:  # one row in consecutive blocks: a view of the pool
                nb = table.shape[1]
                keys = pool[:, g.run : g.run + nb].reshape(H2, 1, nb * bs, d)[:, :, : g.max_end]
            else:
                # index_select, not pool[:, table]: the same copy, ~4x faster on the CPU (advanced indexing
                # takes a generic strided path; index_select copies whole (bs, d) blocks)
                keys = pool.index_select(1, table.reshape(-1)).view(H2, g.G, -1, d)[:, :, : g.max_end]
            out = HeadMajorKV(keys, torch.arange(g.max_end, device=keys.device).expand(g.G, -1))
        elif layer in c.paged:
            pool = c.paged[layer]
            table = g.tables[c.unit_of_paged[layer]]
            bs = c.block_size
            if write:
                pos = g.qpos  # (G, T)
                flat = table.gather(1, pos // bs) * bs + pos % bs
                pool.view(-1, pool.shape[-1]).index_copy_(
                    0, flat.reshape(-1), entries.reshape(-1, entries.shape[-1]).to(pool.dtype)
                )
            if g.row_pieces is not None:  # decode rows read as views: per row, its pieces (S_i, E)
                out = RowPieces(
                    [[pool[b : b + n].reshape(n * bs, pool.shape[-1])[:e] for b, n, e in pieces] for pieces in g.row_pieces]
                )
                self.scratch[key] = out
                return out
            if g.run is not None:
                keys = pool[g.run : g.run + table.shape[1]].reshape(1, -1, pool.shape[-1])[:, : g.max_end]
            else:
                keys = pool.index_select(0, table.reshape(-1)).view(g.G, -1, pool.shape[-1])[:, : g.max_end]
            kpos = torch.arange(g.max_end, device=keys.device).expand(g.G, -1)
            out = Entries(keys, kpos)
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
            if g.run is not None:
                entries = seg[g.run : g.run + table.shape[1]].reshape(1, -1, seg.shape[-1])[:, :N]
            else:
                entries = seg.index_select(0, table.reshape(-1)).view(g.G, -1, seg.shape[-1])[:, :N]
            first = (torch.arange(N, device=entries.device) * m).expand(g.G, -1)
            self.scratch[key] = (entries, first)
        seg_entries: tuple[torch.Tensor, torch.Tensor] = self.scratch[key]
        return seg_entries
