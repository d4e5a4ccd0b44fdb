"""The engine's prefix policy: which kept prompt a request starts from, where its own prompt is kept, what is
evicted, and the replays that rebuild what depends on the adapter (the store and the replay rule:
:mod:`kvgraft.runtime.prefix`).

:class:`PrefixPolicy` is called by the scheduler when it admits a request (:meth:`~PrefixPolicy.match`,
:meth:`~PrefixPolicy.restore`, :meth:`~PrefixPolicy.admitted`) and when it needs blocks
(:meth:`~PrefixPolicy.evict_one`: entries go before any request is preempted), and by the engine around a
step's forward (:meth:`~PrefixPolicy.run_replays` before it, :meth:`~PrefixPolicy.keep_hidden` and
:meth:`~PrefixPolicy.after_row` after it).
"""

from __future__ import annotations

import torch

from kvgraft.model.batch import BatchContext
from kvgraft.model.blocks import CacheFullError
from kvgraft.model.cache import PagedKVCache
from kvgraft.model.transformer import Transformer
from kvgraft.runtime.prefix import PrefixCache, PrefixEntry
from kvgraft.runtime.request import Request

Hit = tuple[PrefixEntry, int | None]  # the entry a request reuses, and the layer a replay rebuilds from (None: none)


class PrefixPolicy:
    """The prefix cache as the engine uses it (see the module docstring). ``stats`` is the engine's
    ``prefix_stats`` dict: queries, hits, replays and replayed tokens are counted into it."""

    def __init__(
        self,
        model: Transformer,
        cache: PagedKVCache,
        store: PrefixCache,
        replay_layer: int | None,
        max_batch_tokens: int,
        stats: dict[str, int],
        device: torch.device,
    ) -> None:
        self.model, self.cache, self.store, self.device = model, cache, store, device
        self.replay_layer = replay_layer
        self.max_batch_tokens = max_batch_tokens
        self.stats = stats
        self._replays: list[tuple[Request, PrefixEntry, int]] = []

    # ---- admission ---------------------------------------------------------------------------------
    def match(self, req: Request) -> Hit | None:
        """The prefix entry ``req`` reuses (and the layer a replay rebuilds from); decides where its own
        prompt is kept (``keep_at``): all but the prompt's last token, and the point where it forks from
        a kept prompt (a shared system prompt, say), so that later requests sharing that part hit."""
        req.keep_at, req.hidden = [], []
        if len(req.prompt) <= self.cache.block_size:
            return None
        store = self.store
        hit = store.match(req.prompt, req.owner, req.shares, req.same_below)
        done = hit[0].length if hit else 0
        if hit and hit[1] is not None and store.span is None:
            done -= 1  # a full-attention replay rebuilds the adapter's own layers: keep them too (after it)
        T = len(req.prompt) - 1
        fork = store.fork_point(req.prompt)
        for point in (fork, T):
            if (
                self.cache.block_size <= point <= T
                and point > done
                and point not in req.keep_at
                and not store.covers(req.prompt[:point], req.owner, req.shares, req.same_below)
            ):
                req.keep_at.append(point)
        return hit

    def restore(self, hit: Hit) -> int | None:
        """A cache sequence restored from the hit's entry (a replay's layers fresh, the rest shared), evicting
        other entries while the pool is short; None when it cannot be had."""
        entry, recompute = hit
        while True:
            try:
                return self.cache.restore(entry.snap, recompute_from=recompute)
            except CacheFullError:
                if not self.store.evict_one(spare=entry):
                    return None

    def admitted(self, req: Request, hit: Hit | None) -> None:
        """Count ``req``'s query and hit; queue its replay; start its kept replay-layer inputs from the entry's."""
        if len(req.prompt) > self.cache.block_size:
            self.stats["queries"] += 1
        if hit:
            entry, replay = hit
            self.stats["hits"] += 1
            if replay is not None:
                self._replays.append((req, entry, replay))
            if entry.hidden is not None and req.keep_at:
                req.hidden = [(entry.length - entry.hidden.shape[0], entry.hidden)]

    def clear_home(self, seq: int) -> None:
        """Kept prompts out of the home run of a new sequence (relocated, else dropped): there it reads its
        blocks as a view of the pools rather than a gather (``PagedKVCache.home_view``)."""
        self.store.clear_run(*self.cache.home_run(seq))

    def evict_one(self) -> bool:
        """Evict the least recently used entry; False if there is none."""
        return self.store.evict_one()

    def forget(self, req: Request) -> None:
        """``req`` was preempted: its pending replay goes (it restarts from its admission)."""
        self._replays = [(r, e, x) for r, e, x in self._replays if r is not req]

    def drop_owner(self, owner: int) -> None:
        """An adapter was unloaded: drop the entries only it could use."""
        self.store.drop_owner(owner)

    # ---- around a step -----------------------------------------------------------------------------
    def run_replays(self) -> None:
        """Rebuild the decoder windows (causal encoder-decoder) or the adapter's own layers (full-attention
        base) of requests that reuse another adapter's prefix (:mod:`kvgraft.runtime.prefix`: the replay rule)."""
        for req, entry, layer in self._replays:
            if req.seq is None:
                continue
            if entry.hidden is not None:  # causal encoder-decoder: the decoder over the replay span
                n = entry.hidden.shape[0]
                assert self.replay_layer is not None  # kept hidden states: a causal encoder-decoder
                ctx = BatchContext(self.cache, [req.seq], [n], adapter_ids=[req.adapter], replay=True)
                self.model.replay(entry.hidden, ctx, self.replay_layer)
            else:  # full-attention base: every position again, in chunks, rewriting layers from ``layer`` on
                n = entry.length
                ids = torch.tensor(entry.tokens, device=self.device)
                for a in range(0, n, self.max_batch_tokens):
                    k = min(self.max_batch_tokens, n - a)
                    ctx = BatchContext(
                        self.cache, [req.seq], [k], adapter_ids=[req.adapter], replay=True, write_from=layer, replay_at=[a]
                    )
                    self.model.replay(self.model.embed_tokens(ids[a : a + k])[None], ctx, 0)
                if req.keep_at and req.keep_at[0] == req.computed:  # its own entry: the next request of
                    self.keep(req)  # this adapter reuses it as it is (the lower layers are the same blocks)
            self.stats["replays"] += 1
            self.stats["replayed_tokens"] += n
        self._replays = []

    def needs_hidden(self, req: Request) -> bool:
        """Whether the step must capture ``req``'s replay-layer inputs (its prompt is kept for replays)."""
        return bool(req.keep_at) and req.shares and self.store.span is not None

    def keep_hidden(self, ctx: BatchContext, rows: list[tuple[Request, int]]) -> None:
        """Keep, for requests whose prompt will be kept, the replay layer's inputs over the replay spans."""
        span = self.store.span
        assert span is not None and ctx.captured is not None  # only called when a row needs them
        for i, (req, n) in enumerate(rows):
            if not self.needs_hidden(req):
                continue
            lo = max(req.computed, req.keep_at[0] - span)
            hi = min(req.computed + n, req.keep_at[-1])
            if lo < hi:
                off = ctx.offsets[i] - req.computed
                req.hidden.append((lo, ctx.captured[0, off + lo : off + hi].clone()))

    def after_row(self, req: Request) -> None:
        """``req``'s row ran (``req.computed`` updated): keep its cache if it reached its next keep point."""
        if req.keep_at and req.computed == req.keep_at[0]:
            self.keep(req)

    def keep(self, req: Request) -> None:
        """Snapshot ``req``'s cache at its first keep point (``req.computed`` tokens) into the prefix cache."""
        span = self.store.span
        T = req.keep_at.pop(0)
        hidden = None
        if req.shares and span is not None:
            want = T - min(span, T)
            parts: list[torch.Tensor] = []
            pos = want
            for start, h in sorted(req.hidden, key=lambda p: p[0]):
                end = start + h.shape[0]
                if end <= pos or start > pos:
                    continue
                parts.append(h[pos - start : T - start])
                pos = min(end, T)
                if pos >= T:
                    break
            if pos >= T:
                hidden = torch.cat(parts)
        snap = self.cache.snapshot(req.cache_seq)
        if self.cache.head_major and snap.length % self.cache.block_size and snap.blocks:
            # the request writes on into its partial last block: the kept copy gets its own (else the request's
            # next write would copy it away from its home run, which decode reads as a view)
            last = snap.blocks[-1]
            snap = self.cache.relocate(snap, last, last + 1) or snap
        self.store.insert(req.prompt[:T], snap, req.owner, req.shares, hidden, req.same_below)
        if req.keep_at:  # drop what the next keep point's span does not need
            first = req.keep_at[0] - span if span else 0
            req.hidden = [(st, h) for st, h in req.hidden if st + h.shape[0] > first]
        else:
            req.hidden = []
