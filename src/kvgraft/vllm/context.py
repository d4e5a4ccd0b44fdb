"""A kvgraft step context over vLLM's paged caches: kvgraft's own CED layers run unchanged inside vLLM.

kvgraft's layers talk to storage through three calls of :class:`kvgraft.model.batch.StepContext`
(``kv``, ``compress``, ``segment``). :class:`VllmStepContext` answers them from the blocks vLLM
allocated (``kvgraft.vllm.cache``), addressed through the block tables and slot mappings of the step's
attention metadata, so attention, pooling and masks are the very code kvgraft's engine runs
(``CEDAttention.forward``: one softmax over the window and the visible shared entries). Each request
of the step is one group of one row; nothing per request is kept between steps.

Per request r of the step (tokens ``start .. L - 1`` with ``L = seq_lens[r]``):

- ``kv`` writes the new window rows at their slots, then reads positions ``max(0, start - W + 1) .. L - 1``
  (vLLM keeps the last W - 1 tokens' blocks);
- ``compress`` (kv_source layers) writes each new token's ``[entry ; gate scores]`` to the pending cache,
  then pools every block whose last token arrived in this step from the pending rows (its earlier
  tokens, at most m - 1, are still inside the pending window) and writes the entry to the stream;
- ``segment`` reads the source's stream entries ``0 .. L // m - 1``; the layer masks them by
  ``b m <= i - W`` (``shared_visible``).
"""

from __future__ import annotations

from typing import Any

import torch

from kvgraft.model.batch import BatchContext, EntryWriter
from kvgraft.model.plan import Group
from kvgraft.model.views import Entries, KVView
from kvgraft.vllm.cache import PENDING, STREAM, WINDOW, CEDCacheLayer, CEDCacheMetadata

_CACHED = object()  # stands for "the step reads a cache" where kvgraft's layers ask


class VllmStepContext(BatchContext):
    """One vLLM forward step over the CED caches ``layers[(layer, kind)]`` (``kvgraft.vllm.cache`` names).

    ``metadata`` maps each cache layer's vLLM name to its group's :class:`CEDCacheMetadata`;
    ``positions`` (N,) are vLLM's token positions on the packed axis; ``adapters`` (per request of the step,
    vLLM's order) names each request's adapter in kvgraft's registry (None: the base). A ``BatchContext`` to
    kvgraft's adapter layers (``MultiLoraLinear`` applies deltas inside one), but none of its paged-cache
    state: its constructor is not run, and every storage call is answered here."""

    ring_kernel = False  # kvgraft's CED decode kernel reads kvgraft's rings and segments; these live in vLLM's blocks

    def __init__(
        self,
        layers: dict[tuple[int, str], CEDCacheLayer],
        metadata: dict[str, Any],
        positions: torch.Tensor,
        window: int,
        compress_rate: int,
        adapters: list[str | None] | None = None,
    ) -> None:
        self.layers, self.window, self.m = layers, window, compress_rate
        self.md: dict[tuple[int, str], CEDCacheMetadata] = {key: metadata[c.layer_name] for key, c in layers.items()}
        any_md = next(iter(self.md.values()))
        self.scratch = {}
        # not kvgraft's cache, but a cached step: CEDAttention takes the absorbed path for decode rows, as
        # kvgraft's engine does (it only tests ``ctx.cache is not None``)
        self.cache = _CACHED  # type: ignore[assignment]
        self.groups, self.ends, self.requests = [], [], []
        qs, lens = any_md.query_start, any_md.seq_lens
        for r in range(len(lens)):
            T = qs[r + 1] - qs[r]
            if T <= 0:
                continue
            tok = torch.arange(qs[r], qs[r + 1], device=positions.device)
            qpos = positions.index_select(0, tok).view(1, T).long()
            start = lens[r] - T
            if int(qpos[0, 0]) != start or int(qpos[0, -1]) != lens[r] - 1:
                raise ValueError(f"request {r}: positions {qpos[0, 0]}..{qpos[0, -1]} do not end at its length {lens[r]}")
            adapter = adapters[r] if adapters is not None else None
            self.groups.append(Group([len(self.groups)], T, qpos, tok=tok, adapter=adapter))
            self.ends.append(lens[r])
            self.requests.append(r)
        self.adapter_ids = [g.adapter for g in self.groups]
        # per request of the step in vLLM's order (requests without new tokens included): the batched path's tiles
        self.request_adapters: list[object] = list(adapters) if adapters is not None else [None] * len(lens)
        self.new_tokens = [g.T for g in self.groups]
        self.has_adapters = any(a is not None for a in self.adapter_ids)
        self.num_tokens = int(positions.shape[0])  # the packed axis (padding included) the layers see
        self.replay = False

    def adapter_tokens(self) -> dict[object, torch.Tensor]:
        """Adapter -> indices (on the packed token axis) of its requests' tokens; the base is left out."""
        by: dict[object, list[torch.Tensor]] = {}
        for g in self.groups:
            if g.adapter is not None and g.tok is not None:
                by.setdefault(g.adapter, []).append(g.tok)
        return {a: torch.cat(ix) for a, ix in by.items()}

    def token_adapters(self) -> list[object]:
        """The adapter of each token of the packed axis (None for the base and for padding)."""
        out: list[object] = [None] * self.num_tokens
        for g in self.groups:
            if g.adapter is not None and g.tok is not None:
                for t in g.tok.tolist():
                    out[t] = g.adapter
        return out

    def commit(self) -> None:
        """Nothing to record: vLLM's scheduler owns the sequences."""

    # ---- addressing ---------------------------------------------------------------------------
    def _slots(self, layer: int, kind: str, gi: int, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(block ids, rows within the block) of positions ``pos`` (1-D) of group ``gi``'s request in one cache."""
        md = self.md[(layer, kind)]
        g = self.layers[(layer, kind)].geometry
        per_row = g.compress_rate if kind == STREAM else 1  # a stream row holds m tokens' entry
        block = md.block_size
        table = md.block_table[self.requests[gi]]
        return table.index_select(0, pos // block).long(), (pos % block) // per_row

    def _write_new(self, layer: int, kind: str, gi: int, rows: torch.Tensor) -> None:
        """Rows (T, width) of group ``gi``'s new tokens at their slots (vLLM's slot mapping; -1 skipped)."""
        md, g = self.md[(layer, kind)], self.groups[gi]
        if g.tok is None:
            raise ValueError("a vLLM step's groups index the packed token axis")
        slots = md.slot_mapping.index_select(0, g.tok).long()
        keep = slots >= 0
        if not bool(keep.all()):
            slots, rows = slots[keep], rows[keep]
        cache = self.layers[(layer, kind)].rows()
        cache[slots // md.block_size, slots % md.block_size] = rows.to(cache.dtype)

    def _read(self, layer: int, kind: str, gi: int, pos: torch.Tensor) -> torch.Tensor:
        blocks, rows = self._slots(layer, kind, gi, pos)
        return self.layers[(layer, kind)].rows()[blocks, rows]

    # ---- the three storage calls of StepContext -------------------------------------------------
    def kv(self, layer: int, gi: int, entries: torch.Tensor | None) -> KVView:
        if entries is None:
            raise ValueError(f"layer {layer}: every CED layer writes its own window (no reader call)")
        g = self.groups[gi]
        self._write_new(layer, WINDOW, gi, entries[0])
        end = self.ends[gi]
        pos = torch.arange(max(0, end - g.T - self.window + 1), end, device=g.qpos.device)
        return Entries(self._read(layer, WINDOW, gi, pos)[None], pos[None])

    def compress(
        self, layer: int, gi: int, compressor: EntryWriter, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> None:
        g, m, end = self.groups[gi], self.m, self.ends[gi]
        entries = compressor.token_entries(x, cos, sin)  # (1, T, E)
        E = entries.shape[-1]
        if m == 1:
            self._write_stream(layer, gi, g.qpos[0], entries[0])
            return
        scores = compressor.gate_scores(x, g.qpos)  # (1, T, D)
        self._write_new(layer, PENDING, gi, torch.cat([entries, scores.to(entries.dtype)], dim=-1)[0])
        first, last = (end - g.T) // m, end // m  # blocks whose last token arrived in this step
        if last <= first:
            return
        pos = torch.arange(first * m, last * m, device=g.qpos.device)
        rows = self._read(layer, PENDING, gi, pos)[None]  # (1, n m, E + D)
        pooled = compressor.pool(rows[..., :E], rows[..., E:])  # (1, n, E)
        self._write_stream(layer, gi, pos[::m], pooled[0])

    def _write_stream(self, layer: int, gi: int, first_pos: torch.Tensor, entries: torch.Tensor) -> None:
        blocks, rows = self._slots(layer, STREAM, gi, first_pos)
        cache = self.layers[(layer, STREAM)].rows()
        cache[blocks, rows] = entries.to(cache.dtype)

    def segment(self, source: int, gi: int) -> tuple[torch.Tensor, torch.Tensor]:
        key = ("segment", source, gi)
        hit = self.scratch.get(key)
        if hit is None:
            n = self.ends[gi] // self.m
            first = torch.arange(n, device=self.groups[gi].qpos.device) * self.m
            hit = self.scratch[key] = (self._read(source, STREAM, gi, first)[None], first[None])
        out: tuple[torch.Tensor, torch.Tensor] = hit
        return out
