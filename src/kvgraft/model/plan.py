"""One step's layout, planned by the cache owner: rows, groups, blocks, rings, positions, one read strategy.

:func:`plan_step` ``(cache, seqs, new_tokens, ...)`` reserves what the step writes in the cache
(blocks, copy on write, ring blocks) and returns a :class:`StepPlan`, immutable: the packed token axis
(each row's offset, every token's position, each row's last token) and the *groups* of rows attended
together (rows adding the same number of tokens; on MLA models also the same adapter). A group carries its
rows' positions, their block tables (per layer span), ring-block tables, state slots, and **one read
strategy**, a tagged value (``Group.read``) that attention dispatches on:

- :class:`Gather`: the group's blocks are copied into one tensor per layer (``index_select``);
- :class:`Run`: one row whose blocks are consecutive ids: a view of the pools, no copy;
- :class:`Home`: decode rows whose blocks are their slots' home runs: one strided view of each GQA pool;
- :class:`Pieces`: decode rows read as a few views each (runs of consecutive blocks), attended one row at a
  time (worth it on the CPU once a row holds ``ReadPolicy.row_view_min_bytes`` a layer).

:class:`kvgraft.model.batch.BatchContext` is a thin holder of a plan and the forward's scratch.

The plan is built with array ops over the cache's per-slot tables (``PagedKVCache.slot_tables``, kept in
step with every allocation): a step's reservation check, tables, positions and token indices take no
Python loop over its rows. What is left per row: mapping sequence ids to slots (a dict lookup each), rows
that need blocks, a copy on write, ring blocks or overflow checks (the cache's own ``extend``), rows whose
layers were split into spans by a restore (replays over a shared prompt), and the :class:`Pieces` strategy,
whose attention runs per row anyway. Shapes: G rows of a group, T new tokens per row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvgraft.checks import check_int, is_int
from kvgraft.model.attention_ops import DECODE_MAX_NEW_TOKENS
from kvgraft.model.blocks import CacheFullError

if TYPE_CHECKING:
    from kvgraft.model.cache import PagedKVCache

__all__ = [
    "GATHER",
    "Gather",
    "Group",
    "Home",
    "MAX_ROW_PIECES",
    "MIXED",
    "Pieces",
    "ROW_VIEW_MIN_BYTES",
    "Read",
    "ReadPolicy",
    "Run",
    "StepPlan",
    "plan_step",
]


class _Mixed:
    def __repr__(self) -> str:
        return "MIXED"


MIXED = _Mixed()  # Group.adapter of a group whose rows use different adapters

# A decode row is read as views when its blocks form at most this many consecutive pieces (a row restored
# from the prefix cache: the kept prompt's blocks, then its own), else the batch is gathered.
MAX_ROW_PIECES = 8

# Per-row views replace the batch gather from this many bytes of keys + values per row and layer (CPU): measured
# crossover on the Llama reference between 256 tokens (256 kB: the gather still faster) and 1024 (1 MB: views
# 3-4x faster at batch 8), bench/paged_views.py.
ROW_VIEW_MIN_BYTES = 512 * 1024


# ---- the read strategy: one tagged value per group -------------------------------------------------
@dataclass(frozen=True)
class Gather:
    """Copy the group's blocks (padded block tables) into one tensor per layer."""


@dataclass(frozen=True)
class Run:
    """One row whose blocks are the consecutive ids from ``first``: read as a view of each pool."""

    first: int


@dataclass(frozen=True)
class Pieces:
    """Decode rows (T = 1) read as views: per row, its cache as a few runs of consecutive blocks, each
    (first block id, blocks, tokens); paged layers attend each row over its pieces."""

    rows: tuple[tuple[tuple[int, int, int], ...], ...]


GATHER = Gather()


@dataclass(frozen=True)
class Home:
    """Decode rows whose blocks are their slots' home runs: slots [lo, hi) read as one strided view of each
    GQA pool; ``index``: each row's place in that range (None: the rows are the range in order). The other
    paged layers of a model that mixes kinds (MLA latents) read ``rest``: per-row pieces, or a gather."""

    lo: int
    hi: int
    index: torch.Tensor | None
    rest: Gather | Pieces = GATHER


Read = Gather | Run | Home | Pieces


# What one more group of a step costs, in query-key pairs of attention (its per-layer ops: a gather, a mask,
# a few matmuls and copies, about 50-100 us, against 0.2-0.4 us a pair on SmolLM2-135M's shapes). A prior from
# op counts, not a measurement: bench/engine_profile.py --split-lengths on/off is how to settle it.
GROUP_COST_PAIRS = 256


@dataclass(frozen=True)
class ReadPolicy:
    """Which reads a plan may choose: ``views`` (False: always gather), ``home`` (decode rows at home read one
    strided view; False: they are gathered), per-row views from ``row_view_min_bytes`` a row and layer (CPU only),
    at most ``max_row_pieces`` pieces a row. ``paged``: on the CPU, GQA layers may attend every row of the step in
    one call through the rows' block tables (:attr:`StepPlan.rows`; False: group by group). ``split_lengths``: on
    the CPU, a gathered group of rows at different lengths is cut by length (at most three parts) where the padded
    query-key pairs saved exceed ``group_cost`` a part, so short rows are not padded to the longest
    (:func:`length_split`); not on an accelerator, where a group's cost is kernel launches that the prior does not
    model."""

    views: bool = True
    row_view_min_bytes: int = ROW_VIEW_MIN_BYTES
    max_row_pieces: int = MAX_ROW_PIECES
    home: bool = True
    split_lengths: bool = True
    group_cost: int = GROUP_COST_PAIRS
    paged: bool = True


@dataclass(frozen=True)
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
    # per ring group: (G, ring blocks) ring-block tables (never-written blocks read as block 0)
    rings: tuple[torch.Tensor, ...] = ()
    # per unit (paged layer or segment: cache.unit_of_*): (G, blocks), shared by units of one span
    tables: tuple[torch.Tensor, ...] = ()
    read: Read = GATHER  # how attention reads the group's paged layers
    # (first, end) when the group's tokens are one range of the packed token axis, in ``tok``'s order
    # (consecutive rows: the usual case), so that take is a view and put one slice copy
    span: tuple[int, int] | None = None

    # the read strategy in the shapes the context had before it was one field (read by tests and benchmarks)
    @property
    def run(self) -> int | None:
        """The first block id of a :class:`Run` read, else None."""
        return self.read.first if isinstance(self.read, Run) else None

    @property
    def home(self) -> tuple[int, int, torch.Tensor | None] | None:
        """(first slot, end slot, index) of a :class:`Home` read, else None."""
        r = self.read
        return (r.lo, r.hi, r.index) if isinstance(r, Home) else None

    @property
    def row_pieces(self) -> tuple[tuple[tuple[int, int, int], ...], ...] | None:
        """Each row's pieces of a :class:`Pieces` read (or of a :class:`Home` read's other layers), else None."""
        r = self.read.rest if isinstance(self.read, Home) else self.read
        return r.rows if isinstance(r, Pieces) else None

    def paged_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(starts (G,), state slots (G,)) of a group of cache rows; ValueError for the dense batch."""
        if self.starts is None or self.slots is None:
            raise ValueError("a group of the dense batch holds no cache rows")
        return self.starts, self.slots

    @property
    def G(self) -> int:
        return len(self.rows)

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """(B, N, ...) step tensor -> (G, T, ...) this group's rows: a view when the group's tokens are one
        range of the token axis (``span``; callers only read it), else a copy."""
        if self.tok is None:
            return t
        if self.span is not None:
            return t[0, self.span[0] : self.span[1]].view(self.G, self.T, *t.shape[2:])
        return t[0].index_select(0, self.tok).view(self.G, self.T, *t.shape[2:])

    def put(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Write (G, T, ...) ``y`` into the step tensor ``out`` (B, N, ...); returns ``out``."""
        if self.tok is None:
            return y
        flat = y.reshape(self.G * self.T, *y.shape[2:]).to(out.dtype)
        if self.span is not None:
            out[0, self.span[0] : self.span[1]].copy_(flat)
        else:
            out[0].index_copy_(0, self.tok, flat)
        return out


@dataclass(frozen=True)
class StepPlan:
    """One forward step over sequences of a cache (see the module docstring). Rows are packed on one token
    axis in row order; ``starts[r]`` is the first position row ``r`` runs (its cached length, or for a
    replay the first replayed position)."""

    seqs: tuple[int, ...]
    new_tokens: tuple[int, ...]
    starts: tuple[int, ...]
    offsets: tuple[int, ...]  # each row's first index on the packed token axis
    num_tokens: int
    positions: torch.Tensor  # (1, N) every token's position
    last_index: torch.Tensor  # (rows,) each row's last token on the packed axis
    groups: tuple[Group, ...]
    replay: bool = False
    write_from: int | None = None
    # the step's rows for attention in one call over a paged pool (``ReadPolicy.paged``, CPU, GQA pools), else
    # None: (rows, 3) int64 per row its offset on the packed axis, new tokens, first position
    rows: torch.Tensor | None = None
    # with ``rows``: per unit (cache.unit_of_*), the rows' block tables (rows, blocks), shared by units of one span
    row_tables: tuple[torch.Tensor, ...] = ()

    @property
    def keys_needed(self) -> int:
        """Query-key pairs the step's rows need per layer of full attention: each new token against its own
        prefix and itself (T rows of ``start + T`` keys)."""
        return sum(t * (s + t) for s, t in zip(self.starts, self.new_tokens))

    @property
    def keys_read(self) -> int:
        """Query-key pairs the planned reads attend per layer of full attention: a padded group reads every
        row to its longest (``G T max_end``), a home view every slot of its range, pieces and a run only their
        own keys; a step planned for one call over its rows' block tables (``rows``: the CPU kernel reads each row's
        own keys; without it the groups run) only what is needed. ``keys_read / keys_needed`` is the step's padding."""
        if self.rows is not None:
            return self.keys_needed
        total = 0
        for g in self.groups:
            r = g.read
            if isinstance(r, Home):
                total += (r.hi - r.lo) * g.T * g.max_end
            elif isinstance(r, Pieces | Run):
                total += sum(self.new_tokens[i] * (self.starts[i] + self.new_tokens[i]) for i in g.rows)
            else:
                total += g.G * g.T * g.max_end
        return total


def length_split(ends: np.ndarray, T: int, group_cost: int) -> list[np.ndarray]:
    """Rows of one group (``ends``: each row's keys after the step; ``T`` new tokens each) cut into at most three
    parts by length, minimizing the padded query-key pairs (a part reads every row to its longest) plus
    ``group_cost`` pairs per part beyond the first; each part's row indices in row order. One part when cutting
    saves nothing. Exact over all cuts of the rows sorted by length, with array ops (G^2 candidates)."""
    G = len(ends)
    order = np.argsort(ends, kind="stable")
    e = ends[order].astype(np.int64)
    best, cuts = G * int(e[-1]) * T, np.empty(0, dtype=np.int64)
    if G >= 2:
        i = np.arange(1, G)
        two = (i * e[i - 1] + (G - i) * e[-1]) * T + group_cost
        k = int(two.argmin())
        if two[k] < best:
            best, cuts = int(two[k]), i[k : k + 1]
    if G >= 3:
        a, b = np.meshgrid(np.arange(1, G), np.arange(1, G), indexing="ij")
        three = ((a * e[a - 1] + (b - a) * e[b - 1] + (G - b) * e[-1]) * T + 2 * group_cost).astype(np.float64)
        three[a >= b] = np.inf
        k = int(three.argmin())
        if three.flat[k] < best:
            best, cuts = int(three.flat[k]), np.array([a.flat[k], b.flat[k]])
    return [np.sort(part) for part in np.split(order, cuts)]


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


def _check(
    cache: PagedKVCache,
    seqs: list[int],
    new_tokens: list[int],
    adapter_ids: list[object] | None,
    replay: bool,
    write_from: int | None,
    replay_at: list[int] | None,
) -> None:
    if len(seqs) != len(new_tokens) or not seqs:
        raise ValueError(f"seqs ({len(seqs)}) and new_tokens ({len(new_tokens)}) must be non-empty and of equal length")
    if len(set(seqs)) != len(seqs):
        raise ValueError(f"a sequence appears twice in one step: {seqs}")
    if any(not is_int(t) or t < 1 for t in new_tokens):
        raise ValueError(f"new_tokens {new_tokens} must be positive integers")
    if adapter_ids is not None and len(adapter_ids) != len(seqs):
        raise ValueError(f"adapter_ids has {len(adapter_ids)} entries for {len(seqs)} rows")
    if replay_at is not None:
        if not replay or write_from is None or len(replay_at) != len(seqs):
            raise ValueError(
                "replay_at (one first position per row) is for a full-attention replay (replay=True with write_from)"
            )
        for s, t, a in zip(seqs, new_tokens, replay_at):
            if not is_int(a) or a < 0 or a + t > cache.length(s):
                raise ValueError(f"replay of positions [{a}, {a} + {t}) on sequence {s}, which holds {cache.length(s)} tokens")


def _reserve(cache: PagedKVCache, seqs: list[int], new_tokens: list[int], slots: np.ndarray, replay: bool) -> None:
    """Make room for the step's writes (see :func:`plan_step`)."""
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
        return
    # rows whose blocks are already reserved (the engine's scheduler reserved them) and whose next block is
    # their own need nothing: found with array ops; the rest go through the cache's extend
    todo = np.flatnonzero(~cache.reserved(slots, np.asarray(new_tokens, dtype=np.int64)))
    for i in todo.tolist():
        if not cache.can_extend(seqs[i], new_tokens[i]):
            cache.extend(seqs[i], new_tokens[i])  # raises the precise error (overflow or no free blocks)
    for i in todo.tolist():
        cache.extend(seqs[i], new_tokens[i])


def _check_write_from(cache: PagedKVCache, seqs: list[int], replay: bool, write_from: int | None) -> None:
    if write_from is None:
        return
    if not replay:
        raise ValueError("write_from is for a replay (BatchContext(..., replay=True))")
    n = cache.config.num_layers
    check_int("write_from", write_from, low=0, high=n - 1, accepted=f"a layer index in [0, {n})")
    cut = next((u for u, (k, x) in enumerate(cache.units) if x >= write_from), len(cache.units))
    for s in seqs:  # the layers it rewrites must hold their own blocks (a restore with recompute_from)
        for u in range(cut, len(cache.units)):
            if any(cache.refcount(b, u) > 1 for b in cache.block_table(s, u)):
                raise ValueError(
                    f"replay of sequence {s} would write blocks of layer {cache.units[u][1]} "
                    "that other sequences share; restore it with recompute_from first"
                )


def _row_views_pay(cache: PagedKVCache, ends: np.ndarray, min_bytes: int) -> bool:
    """Whether decode rows should attend over per-row views of the paged pools (GQA keys/values, MLA
    latents) rather than one gathered copy: on the CPU, once the average row's largest paged layer holds
    ``min_bytes``. Below that the gather is cheap and a few small ops per row cost more; above it the
    gather's copy (and the fresh pages the allocator maps for it) dominates the step (bench/paged_views.py).
    On an accelerator the gather is a fast device copy and per-row ops would each launch kernels: always
    gather there."""
    if not cache.paged or cache.device.type != "cpu":
        return False
    widths = [
        int(np.prod(cache.head_major[x])) if x in cache.head_major else p.shape[-1] for x, p in cache.paged.items()
    ]  # values per token: 2K x head_dim, or the latent's width
    per_token = max(widths) * torch.empty((), dtype=cache.dtype).element_size()
    return bool(int(ends.sum()) * per_token >= min_bytes * len(ends))


def _buckets(
    cache: PagedKVCache, new_tokens: np.ndarray, codes: np.ndarray | None, slots: np.ndarray, policy: ReadPolicy
) -> list[tuple[int, np.ndarray]]:
    """(new tokens, row indices) per group, groups in order of their first row: rows by new tokens (and by
    adapter code where ``codes`` is given); decode rows split into those at home and the rest."""
    keys = new_tokens if codes is None else new_tokens * (int(codes.max()) + 1) + codes
    uniq, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    out: list[tuple[int, np.ndarray]] = []
    for k in np.argsort(first, kind="stable").tolist():
        rows = np.flatnonzero(inverse == k)
        t = int(new_tokens[rows[0]])
        if (
            policy.views
            and policy.home
            and cache.head_major
            and cache.home_stride
            and t <= DECODE_MAX_NEW_TOKENS
            and len(rows) >= 3
        ):
            at = cache.slots_at_home(slots[rows])
            if int(at.sum()) >= 2:
                out.extend((t, part) for part in (rows[at], rows[~at]) if part.size)
                continue
        out.append((t, rows))
    return out


def plan_step(
    cache: PagedKVCache,
    seqs: list[int],
    new_tokens: list[int],
    adapter_ids: list[object] | None = None,
    *,
    replay: bool = False,
    write_from: int | None = None,
    replay_at: list[int] | None = None,
    policy: ReadPolicy | None = None,
) -> StepPlan:
    """Reserve a step's writes in ``cache`` and plan its layout (see the module
    docstring and :class:`kvgraft.model.batch.BatchContext` for the arguments). Raises ValueError for
    inconsistent arguments, CacheFullError when the pool cannot hold the step."""
    policy = policy or ReadPolicy()
    _check(cache, seqs, new_tokens, adapter_ids, replay, write_from, replay_at)
    slots = np.fromiter((cache.slot(s) for s in seqs), dtype=np.int64, count=len(seqs))
    _reserve(cache, seqs, new_tokens, slots, replay)
    _check_write_from(cache, seqs, replay, write_from)
    dev = cache.device
    t_np = np.asarray(new_tokens, dtype=np.int64)
    if replay_at is not None:
        starts = np.asarray(replay_at, dtype=np.int64)
    else:
        starts = cache.slot_lengths[slots] - (t_np if replay else 0)
    offsets = np.concatenate([[0], np.cumsum(t_np)[:-1]]).astype(np.int64)
    n = int(t_np.sum())
    positions = torch.from_numpy(np.arange(n, dtype=np.int64) + np.repeat(starts - offsets, t_np)).to(dev)[None]
    last_index = torch.from_numpy(offsets + t_np - 1).to(dev)
    adapters: list[object] = list(adapter_ids) if adapter_ids is not None else [None] * len(seqs)
    codes: np.ndarray | None = None
    by_code: list[object] = []
    if any(a is not None for a in adapters):
        index: dict[object, int] = {}
        codes = np.fromiter((index.setdefault(a, len(index)) for a in adapters), dtype=np.int64, count=len(adapters))
        by_code = list(index)
    # MLA's folded decode keeps one fold per weight, so its groups also split by adapter
    split = codes if "mla" in cache.config.attention_kinds else None
    groups = []
    step = _StepRows(seqs, starts, offsets, slots, adapters, codes, by_code, policy)
    for t, rows in _buckets(cache, t_np, split, slots, policy):
        g = _group(cache, step, rows, t)
        parts = (
            length_split(starts[rows] + t, t, policy.group_cost)
            if policy.split_lengths and cache.device.type == "cpu" and g.G >= 2 and isinstance(g.read, Gather)
            else [rows]
        )
        if len(parts) == 1:
            groups.append(g)
            continue
        for part in parts:  # rows at different lengths: each part padded to its own longest only
            groups.append(_group(cache, step, rows[part], t))
    rows_t: torch.Tensor | None = None
    row_tables: tuple[torch.Tensor, ...] = ()
    if policy.paged and cache.head_major and dev.type == "cpu":  # one attention call a GQA layer over all rows
        rows_t = torch.from_numpy(np.stack([offsets, t_np, starts], axis=1))
        row_tables = _tables(cache, list(seqs), slots, -(-int((starts + t_np).max()) // cache.block_size))[2]
    return StepPlan(
        tuple(seqs),
        tuple(new_tokens),
        tuple(starts.tolist()),
        tuple(offsets.tolist()),
        n,
        positions,
        last_index,
        tuple(groups),
        replay,
        write_from,
        rows_t,
        row_tables,
    )


@dataclass(frozen=True)
class _StepRows:
    """What every group of a step is cut from: the step's rows by index (sequence, first new position, offset on
    the packed axis, state slot, adapter and its code) and the read policy."""

    seqs: list[int]
    starts: np.ndarray
    offsets: np.ndarray
    slots: np.ndarray
    adapters: list[object]
    codes: np.ndarray | None
    by_code: list[object]
    policy: ReadPolicy


def _tables(
    cache: PagedKVCache, seqs: list[int], slots: np.ndarray, nb: int
) -> tuple[np.ndarray, torch.Tensor, tuple[torch.Tensor, ...], list[int]]:
    """Block tables of rows (``seqs``, their ``slots``), ``nb`` blocks each: the cache's per-slot tables of each
    row's first layer span (numpy, padded with -1), and per unit (paged layer or segment) the (rows, nb) tensor
    padded with block 0 (masked), shared by the units of one span; rows whose layers a restore split into spans
    (a replay over a shared prompt) get their other spans' tables. Returns (the numpy tables, the first span's
    tensor, the per-unit tensors, the units where spans start)."""
    base = cache.slot_tables[slots, :nb]
    if base.shape[1] < nb:  # a cache whose layers all keep window rings: no blocks, tables of padding only
        base = np.pad(base, ((0, 0), (0, nb - base.shape[1])), constant_values=-1)
    split_rows = np.flatnonzero(cache.slot_split[slots]).tolist()
    cuts = sorted({0, *(u for i in split_rows for u in cache.span_starts(seqs[i]))})
    by_cut: dict[int, torch.Tensor] = {}
    for u in cuts:
        tab = base.copy() if u or split_rows else base
        for i in split_rows:
            tb = cache.block_table(seqs[i], u)[:nb]
            tab[i] = tb + [-1] * (nb - len(tb))
        by_cut[u] = torch.from_numpy(np.maximum(tab, 0)).to(cache.device)
    return base, by_cut[0], tuple(by_cut[max(c for c in cuts if c <= u)] for u in range(len(cache.units))), cuts


def _group(cache: PagedKVCache, step: _StepRows, rows: np.ndarray, t: int) -> Group:
    seqs, starts_all, offsets, slots_all = step.seqs, step.starts, step.offsets, step.slots
    adapters, codes, by_code, policy = step.adapters, step.codes, step.by_code, step.policy
    dev, bs = cache.device, cache.block_size
    G = len(rows)
    adapter: object = adapters[int(rows[0])]
    adapter_rows: tuple[tuple[object, torch.Tensor], ...] = ()
    if codes is not None:
        gcodes = codes[rows]
        uniq, first = np.unique(gcodes, return_index=True)
        if len(uniq) > 1:
            adapter = MIXED
            adapter_rows = tuple(
                (by_code[int(c)], torch.from_numpy(np.flatnonzero(gcodes == c)).to(dev))
                for c in uniq[np.argsort(first, kind="stable")]
            )
    starts = starts_all[rows]
    slots = slots_all[rows]
    ends = starts + t
    max_end = int(ends.max())
    nb = -(-max_end // bs)
    base, table, unit_tables, cuts = _tables(cache, [seqs[int(r)] for r in rows], slots, nb)
    slots_t = torch.from_numpy(slots).to(dev)
    read: Read = GATHER
    if policy.views and len(cuts) == 1:
        row = base[0]
        if G == 1 and nb and row[-1] >= 0 and (nb == 1 or bool((np.diff(row) == 1).all())):
            read = Run(int(row[0]))
        elif (
            G >= 2
            and policy.home
            and cache.head_major
            and t <= DECODE_MAX_NEW_TOKENS
            and (home := cache.home_range(table, slots_t, ends))
        ):
            read = Home(*home)
        if (
            t == 1
            and isinstance(read, Gather | Home)
            and not (isinstance(read, Home) and len(cache.head_major) == len(cache.paged))  # every paged layer reads home
            and _row_views_pay(cache, ends, policy.row_view_min_bytes)
        ):
            pieces = []
            for i, e in enumerate(ends.tolist()):
                p = _pieces(base[i, : -(-e // bs)].tolist(), e, bs)
                if not p or len(p) > policy.max_row_pieces:
                    break
                pieces.append(tuple(p))
            else:
                read = (
                    Home(read.lo, read.hi, read.index, Pieces(tuple(pieces))) if isinstance(read, Home) else Pieces(tuple(pieces))
                )
    tok_np = (offsets[rows][:, None] + np.arange(t)).reshape(-1)
    tok = torch.from_numpy(tok_np).to(dev)
    span = (int(tok_np[0]), int(tok_np[0]) + len(tok_np)) if bool((np.diff(tok_np) == 1).all()) else None
    qpos = torch.from_numpy(starts[:, None] + np.arange(t)).to(dev)
    rings = tuple(torch.from_numpy(np.maximum(cache.slot_rings[gi][slots], 0)).to(dev) for gi in range(len(cache.ring_groups)))
    return Group(
        rows.tolist(),
        t,
        qpos,
        tok,
        torch.from_numpy(starts).to(dev),
        table,
        slots_t,
        max_end,
        adapter,
        adapter_rows,
        rings,
        unit_tables,
        read,
        span,
    )
