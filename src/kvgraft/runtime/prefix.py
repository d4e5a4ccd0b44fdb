"""The prefix cache: prompts' caches kept after their requests, reused by later requests and adapters.

An entry is a snapshot of a request's cache after its prompt minus the last token (``T`` tokens), or at
the point where its prompt forks from a kept one (a shared system prompt, say: the next request that
shares it hits): the paged blocks and window-ring blocks it held (reference counted: entry and requests
share them, copy on write), a copy of its pending tokens, who computed it (``owner``: an adapter's load
identity, None for the base) and, on a causal encoder-decoder, the hidden states entering the pivot
over the positions a decoder replay needs.

**What is shared is keyed by what is actually shared.** A request reuses the longest entry whose tokens
start its prompt (at most all but its last token) when either

- the entry was computed with the same adapter (or both base): everything is reused as it is, or
- both the entry's owner and the request's adapter hold a sharing certificate (the base always does):
  their shared segments and the windows of every layer before the pivot are the base model's, equal for
  both (``kvgraft.adapters.certificate``); only the windows from the pivot on depend on the adapter, and
  they are rebuilt by a **decoder replay** (below) into fresh ring blocks (``PagedKVCache.restore(...,
  recompute_from=pivot)``). The segment blocks and the encoder's ring blocks are referenced, not copied:
  N certified adapters over one prompt hold its segments and its encoder windows once (a decode step
  copies only the ring block it writes).

Adapters without the certificate (they change a shared segment) reuse only their own entries.

Full-attention bases and eviction: :class:`PrefixCache`; the decoder replay's span: :func:`replay_span`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from kvgraft.checks import check_int
from kvgraft.model.cache import CacheSnapshot, PagedKVCache
from kvgraft.model.config import ModelConfig


def replay_layer(config: ModelConfig) -> int | None:
    """The layer a decoder replay starts from (the pivot: the last kv_source layer), or None (no replay:
    not a causal encoder-decoder)."""
    sources = config.kv_source_layers  # set exactly on a causal encoder-decoder (``is_ced``)
    return max(sources) if sources is not None else None


def replay_span(config: ModelConfig) -> int | None:
    """Positions a decoder replay needs at the end of a prefix: ``W + (L - 1 - p) (W - 1)``; None when the
    model has no replay.

    The replay rule. Layer ``j`` of a causal encoder-decoder reads, besides the shared segments (adapter-independent
    for certified adapters), its own window: the keys and values it computed from its input over the last ``W``
    tokens. To rebuild layer ``L-1``'s ring at a prefix of ``T`` tokens, its input is needed at positions ``[T - W,
    T)``; that input is layer ``L-2``'s output, and layer ``L-2``'s output at position ``t`` reads layer ``L-2``'s
    window over ``(t - W, t]``, so layer ``L-2``'s input is needed over ``W - 1`` more positions, and so on down.
    Starting from the pivot ``p`` (the first layer a certified adapter may change: the hidden state entering it is
    adapter-independent), the positions needed are the last

        S = W + (L - 1 - p) (W - 1)

    (all of them when ``T <= S``). The replay runs layers ``p..L-1`` over those positions from the kept pivot
    inputs, reading the rings as empty (its outputs near the start of the span are wrong and never used: each
    layer's result is right from ``W - 1`` positions after its span begins, exactly the span of the layer above) and
    reading the shared segments as they are. The reference causal encoder-decoder (W = 64, L = 8, p = 4): S = 253
    positions through 4 layers, instead of a full prefill of every layer.
    """
    p = replay_layer(config)
    if p is None:
        return None
    W = config.sliding_window
    if W is None:
        raise ValueError("a causal encoder-decoder needs a sliding_window (its layers' windows)")
    return W + (config.num_layers - 1 - p) * (W - 1)


@dataclass
class PrefixEntry:
    tokens: tuple[int, ...]
    snap: CacheSnapshot
    owner: object  # the adapter's load identity; None: the base model
    shares: bool  # computed by the base or a certified adapter: its shared groups are the base's
    hidden: torch.Tensor | None  # (n, h) inputs of the replay layer at positions [T - n, T), n = min(S, T)
    same_below: int | None = None  # full-attention bases: layers below this store the base's KV (None: all)

    @property
    def length(self) -> int:
        return self.snap.length

    @property
    def nbytes(self) -> int:
        h = 0 if self.hidden is None else self.hidden.numel() * self.hidden.element_size()
        return self.snap.state_bytes + h


class PrefixCache:
    """LRU entries over one :class:`PagedKVCache` (see the module docstring).

    Full-attention bases (Llama, MLA). The certificate says which layers' KV an adapter leaves as the base's: every
    layer below ``same_below``, the first layer whose KV-writing projections or input it changes. Two parties (entry
    and request; the base has none changed) share the layers below the lower of their two boundaries ``b``. If
    neither changes any KV, the entry is reused as it is. Otherwise the request restores the entry's blocks for
    layers ``< b`` (reference counted per layer: one block id space, a count per layer and block, so a sequence's
    layers split into spans with their own tables) and gets fresh blocks for layers ``>= b``, which a **full
    replay** fills: every prompt position runs through the model again, layers below ``b`` reading the shared blocks
    (their KV is the base's, bit for bit what they would write) and layers from ``b`` writing their own. No window
    bounds what a full-attention layer reads, so the replay costs a prefill's compute; what it saves is memory: N
    adapters over one prompt hold the lower layers once. The request then keeps its own entry, whose lower layers
    are the same shared blocks, so the adapter's next request reuses it as it is. Models with sliding-window layers
    (Mistral) share only entries reused as they are (their rings are one group).

    Entries are evicted least-recently-used: beyond ``max_entries`` or ``max_bytes`` of kept state outside the pools
    (kept hidden states, pending tokens), and whenever the engine needs blocks or ring blocks (before it preempts
    any request).
    """

    def __init__(
        self,
        cache: PagedKVCache,
        max_entries: int,
        span: int | None,
        max_bytes: int | None = None,
        replay_from: int | None = None,
    ) -> None:
        check_int("max_entries", max_entries, low=1)
        check_int("max_bytes", max_bytes, low=0, optional=True)
        self.cache, self.max_entries, self.span, self.max_bytes = cache, max_entries, span, max_bytes
        self.replay_from = replay_from  # a causal encoder-decoder's pivot (None: a full-attention base)
        layers = cache.config.num_layers
        # full-attention bases share layer ranges only without window rings (one ring group) and with
        # paged KV to share
        self._partial = not cache.config.is_ced and not cache.ring_groups and bool(cache.units)
        self._L = layers
        self._entries: OrderedDict[int, PrefixEntry] = OrderedDict()
        self._next = 0
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        """Bytes of the entries' copied state and kept hidden states (their blocks count in the cache)."""
        return self._bytes

    def match(
        self, prompt: list[int], owner: object, shares: bool, same_below: int | None = None
    ) -> tuple[PrefixEntry, int | None] | None:
        """The longest usable entry for a request (``prompt``, adapter ``owner``, its certificate's
        ``shares`` and, on a full-attention base, ``same_below``: the layers below it store the base's
        KV) and the layer a replay rebuilds from (None: used as it is); None when none is usable."""
        best: tuple[PrefixEntry, int | None] | None = None
        best_score: tuple[int, bool, int] = (-1, False, 0)
        best_key: int | None = None
        for key, e in self._entries.items():
            if e.length > len(prompt) - 1 or (best is not None and e.length < best[0].length):
                continue
            ok, replay = self._use(e, owner, shares, same_below)
            if not ok or tuple(prompt[: e.length]) != e.tokens:
                continue
            score = (e.length, replay is None, replay or 0)  # longest, then no replay, then the least to rebuild
            if best is None or score > best_score:
                best, best_score, best_key = (e, replay), score, key
        if best_key is not None:
            self._entries.move_to_end(best_key)
        return best

    def _use(self, e: PrefixEntry, owner: object, shares: bool, same_below: int | None = None) -> tuple[bool, int | None]:
        """Whether ``e`` is usable by (owner, shares, same_below), and the layer a replay must rebuild
        from (None: everything is reused as it is)."""
        if e.owner == owner:
            return True, None
        if self.span is not None:  # causal encoder-decoder: certified on both sides, decoder replay
            return (True, self.replay_from) if shares and e.shares and e.hidden is not None else (False, None)
        # full-attention base: the layers below both sides' first changed KV are the base's on both
        b = min(self._L if e.same_below is None else e.same_below, self._L if same_below is None else same_below)
        if b >= self._L:
            return True, None
        usable = self._partial and any(x < b for _, x in self.cache.units)
        return (True, b) if usable else (False, None)

    def fork_point(self, prompt: list[int]) -> int:
        """The longest common prefix of ``prompt`` with a kept prompt it does not fully contain (0 if none):
        where the two fork, e.g. the end of a shared system prompt."""
        best = 0
        for e in self._entries.values():
            n = min(len(prompt), e.length)
            if n <= best:
                continue
            d = 0
            while d < n and prompt[d] == e.tokens[d]:
                d += 1
            if d < e.length:
                best = max(best, d)
        return best

    def covers(self, tokens: list[int], owner: object, shares: bool, same_below: int | None = None) -> bool:
        """Whether an entry for exactly ``tokens`` is already usable by (owner, shares) without a new one
        (a full-attention base keeps the request's own entry unless it is reusable as it is: its layers
        below the adapter's first changed KV are the same blocks anyway)."""
        t = tuple(tokens)
        for e in self._entries.values():
            if e.length == len(t) and e.tokens == t:
                ok, replay = self._use(e, owner, shares, same_below)
                if ok and (replay is None or self.span is not None):
                    return True
        return False

    def insert(
        self,
        tokens: list[int],
        snap: CacheSnapshot,
        owner: object,
        shares: bool,
        hidden: torch.Tensor | None,
        same_below: int | None = None,
    ) -> PrefixEntry | None:
        """Keep a snapshot (this cache now owns it); evicts the least recently used entries beyond
        ``max_entries`` or ``max_bytes`` of kept state. None (snapshot released) if it alone exceeds
        ``max_bytes``."""
        if snap.length != len(tokens):
            raise ValueError(f"snapshot of {snap.length} tokens for {len(tokens)} tokens")
        entry = PrefixEntry(tuple(tokens), snap, owner, shares, hidden, same_below)
        if self.max_bytes is not None and entry.nbytes > self.max_bytes:  # would never fit: not kept
            self.cache.release(snap)
            return None
        self._entries[self._next] = entry
        self._next += 1
        self._bytes += entry.nbytes
        while len(self._entries) > self.max_entries or (self.max_bytes is not None and self._bytes > self.max_bytes):
            self.evict_one()
        return entry

    def evict_one(self, spare: PrefixEntry | None = None) -> bool:
        """Drop the least recently used entry other than ``spare`` (its blocks go when nothing else holds
        them); False if there is none."""
        key = next((k for k, e in self._entries.items() if e is not spare), None)
        if key is None:
            return False
        self._drop(self._entries.pop(key))
        return True

    def _drop(self, e: PrefixEntry) -> None:
        self.cache.release(e.snap)
        self._bytes -= e.nbytes

    def drop_owner(self, owner: object) -> None:
        """Drop the entries only ``owner`` could use (an unloaded adapter's private ones)."""
        for key in [k for k, e in self._entries.items() if e.owner == owner and not e.shares]:
            self._drop(self._entries.pop(key))

    def clear_run(self, lo: int, hi: int) -> None:
        """Move kept blocks out of the block ids [lo, hi) (a new sequence's home run, which it then reads as
        a view of the pools): each entry holding some is relocated (its blocks copied elsewhere), or dropped
        when no room is left for the copy."""
        if hi <= lo:
            return
        for key, e in list(self._entries.items()):
            if not any(lo <= b < hi for _, ids in e.snap.spans for b in ids):
                continue
            moved = self.cache.relocate(e.snap, lo, hi)
            if moved is None:
                self._drop(self._entries.pop(key))
            else:
                e.snap = moved

    def clear(self) -> None:
        while self.evict_one():
            pass
