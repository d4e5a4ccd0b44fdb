"""Typed views of what one layer stores, as one group of a forward step reads it.

A step context (:mod:`kvgraft.model.batch`) answers ``kv(layer, group, entries)`` with a view; which class
it is follows from how the entries are laid out, and the context decides that once, when it is built
(the layer's pool: head-major GQA keys and values or one row per token; the group: decode rows read as
views of the pools or one gathered batch). Attention never asks which it got: every view offers the same
three reads, and each class does them the fastest way its layout allows.

- ``attend_heads``: softmax attention of (G, H, T, d) queries over K key/value heads (GQA/MHA/MQA: an
  entry is K keys then K values of width d);
- ``attend_latent``: absorbed attention over latent entries, every query head against the one shared
  latent head (MLA's decode: an entry is the latent, d_c, then the RoPE key);
- ``entries``: the entries as one (G, S, E) tensor by key, with each key's position (G, S) (the expanded
  paths, and every read of a window ring).

``mask`` arguments are callables from key positions (G, S) to the (G, T, S) visibility mask, so a view
that needs no mask (rows of pieces, a plain causal batch) builds none.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvgraft.model.attention_ops import (
    DECODE_MAX_NEW_TOKENS,
    attention_over_pieces,
    grouped_attention,
    grouped_attention_head_major,
    grouped_attention_strided,
    last_positions,
)
from kvgraft.model.cpu_kernels import decode_attention, prefill_attention

MaskOf = Callable[[torch.Tensor], torch.Tensor]  # key positions (G, S) -> (G, T, S) bool, True = attend


class KVView:
    """What one group's queries may read of one layer's stored entries (see the module docstring)."""

    def attend_heads(
        self, q: torch.Tensor, num_kv_heads: int, window: int | None, mask: MaskOf, causal: bool, decode: bool
    ) -> torch.Tensor:
        """(G, H, T, d) queries over the K = ``num_kv_heads`` key/value heads -> (G, H, T, d).

        ``causal``: the plain causal batch (cache-free, default positions, the window no shorter than the
        step), attended with SDPA's causal kernel; ``decode``: a cached step of at most
        ``DECODE_MAX_NEW_TOKENS`` tokens per row, attended by matmuls that do not repeat shared heads."""
        raise NotImplementedError(f"{type(self).__name__} holds no key/value heads")

    def attend_latent(self, q: torch.Tensor, dc: int, window: int | None, scale: float, mask: MaskOf) -> torch.Tensor:
        """(G, H, T, d_c + d_rope) absorbed queries over the latent entries -> (G, H, T, d_c)."""
        raise NotImplementedError(f"{type(self).__name__} holds no latent entries")

    def entries(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(entries (G, S, E) by key, key positions (G, S))."""
        raise NotImplementedError(f"{type(self).__name__} is not read as one tensor of entries")


class Entries(KVView):
    """One tensor of entries by key, (G, S, E), with positions (G, S): the cache-free batch itself, a
    window ring followed by the step's tokens, or a paged layer's rows gathered (or one row's view)."""

    __slots__ = ("data", "kpos")

    def __init__(self, data: torch.Tensor, kpos: torch.Tensor) -> None:
        self.data, self.kpos = data, kpos

    def entries(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data, self.kpos

    def attend_heads(
        self, q: torch.Tensor, num_kv_heads: int, window: int | None, mask: MaskOf, causal: bool, decode: bool
    ) -> torch.Tensor:
        G, H, _, d = q.shape
        K, S = num_kv_heads, self.data.shape[1]
        k = self.data[..., : K * d].view(G, S, K, d).transpose(1, 2)
        v = self.data[..., K * d :].view(G, S, K, d).transpose(1, 2)
        if causal:
            return F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1, enable_gqa=K != H)
        m = mask(self.kpos)
        if decode:
            y = decode_attention(q, k.transpose(0, 1), v.transpose(0, 1), m, None, d**-0.5)
            return y if y is not None else grouped_attention(q, k, v, m, d**-0.5)
        y = prefill_attention(q, k.transpose(0, 1), v.transpose(0, 1), m, None, d**-0.5)
        return y if y is not None else F.scaled_dot_product_attention(q, k, v, attn_mask=m[:, None], enable_gqa=K != H)

    def attend_latent(self, q: torch.Tensor, dc: int, window: int | None, scale: float, mask: MaskOf) -> torch.Tensor:
        ent = self.data[:, None]  # one key/value head shared by all query heads (MQA over the latents)
        return grouped_attention(q, ent, ent[..., :dc], mask(self.kpos), scale)


class HeadMajorKV(KVView):
    """A GQA layer's paged keys and values head-major, (2K, G, S, d) (keys then values per head, each
    head's keys contiguous), with positions (G, S)."""

    __slots__ = ("data", "kpos")

    def __init__(self, data: torch.Tensor, kpos: torch.Tensor) -> None:
        self.data, self.kpos = data, kpos

    def attend_heads(
        self, q: torch.Tensor, num_kv_heads: int, window: int | None, mask: MaskOf, causal: bool, decode: bool
    ) -> torch.Tensor:
        K, H, d = num_kv_heads, q.shape[1], q.shape[-1]
        k_hm, v_hm = self.data[:K], self.data[K:]
        m = mask(self.kpos)
        if q.shape[2] <= DECODE_MAX_NEW_TOKENS:  # decode step
            y = decode_attention(q, k_hm, v_hm, m, None, d**-0.5)
            return y if y is not None else grouped_attention_head_major(q, k_hm, v_hm, m, d**-0.5)
        y = prefill_attention(q, k_hm, v_hm, m, None, d**-0.5)
        if y is not None:
            return y
        return F.scaled_dot_product_attention(
            q, k_hm.transpose(0, 1), v_hm.transpose(0, 1), attn_mask=m[:, None], enable_gqa=K != H
        )


class HomeRows(KVView):
    """Decode rows that hold their blocks in their slots' home runs (``PagedKVCache.home_view``): a GQA
    layer's keys and values as one strided view of the pool over a range of slots, (2K, n, S, d), no copy.
    ``index`` (G,) places each row of the group in the range (None: the rows are the range, in order);
    slots of the range outside the group are attended with every key visible and dropped (zero queries)."""

    __slots__ = ("data", "index", "kpos")

    def __init__(self, data: torch.Tensor, index: torch.Tensor | None, kpos: torch.Tensor) -> None:
        self.data, self.index, self.kpos = data, index, kpos

    def attend_heads(
        self, q: torch.Tensor, num_kv_heads: int, window: int | None, mask: MaskOf, causal: bool, decode: bool
    ) -> torch.Tensor:
        K, d = num_kv_heads, q.shape[-1]
        m = mask(self.kpos)  # (G, T, S)
        y = decode_attention(q, self.data[:K], self.data[K:], m, self.index, d**-0.5)
        if y is not None:  # each row reads its own slot's keys up to its length, in place
            return y
        # every slot of the pool: heads and slots are one batch axis of fixed stride, so one 4-d matmul reads
        # the view in place; a narrower range has a gap between heads: one batched matmul per key head
        attend = (
            grouped_attention_head_major
            if self.data.stride(0) == self.data.shape[1] * self.data.stride(1)
            else grouped_attention_strided
        )
        if self.index is None:
            return attend(q, self.data[:K], self.data[K:], m, d**-0.5)
        n = self.data.shape[1]
        qr = q.new_zeros(n, *q.shape[1:]).index_copy_(0, self.index, q)
        mr = torch.ones(n, *m.shape[1:], dtype=m.dtype, device=m.device).index_copy_(0, self.index, m)
        return attend(qr, self.data[:K], self.data[K:], mr, d**-0.5).index_select(0, self.index)


class RowPieces(KVView):
    """Decode rows read as views of the paged pools, no gather: per row, its cache as a few pieces of
    consecutive blocks in position order (GQA: (2K, 1, S_i, d) each, head-major; other layers: (S_i, E)).
    Every position a row holds is visible to its one new token, up to the layer's window."""

    __slots__ = ("rows",)

    def __init__(self, rows: list[list[torch.Tensor]]) -> None:
        self.rows = rows

    def attend_heads(
        self, q: torch.Tensor, num_kv_heads: int, window: int | None, mask: MaskOf, causal: bool, decode: bool
    ) -> torch.Tensor:
        K, d = num_kv_heads, q.shape[-1]
        y = []
        for r, row in enumerate(self.rows):  # a decode token sees every position, or the last `window`
            pieces = last_positions(row, window, dim=2)
            y.append(attention_over_pieces(q[r : r + 1], [p[:K] for p in pieces], [p[K:] for p in pieces], d**-0.5))
        return torch.cat(y)

    def attend_latent(self, q: torch.Tensor, dc: int, window: int | None, scale: float, mask: MaskOf) -> torch.Tensor:
        rows = [last_positions(row, window, dim=0) for row in self.rows]
        return torch.cat(
            [
                attention_over_pieces(
                    q[r : r + 1], [e[None, None] for e in pieces], [e[None, None, :, :dc] for e in pieces], scale
                )
                for r, pieces in enumerate(rows)
            ]
        )

    def entries(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows joined back into one padded batch (a copy, as a gather would make); positions past a
        row's end are masked by the caller's mask as in the gathered batch."""
        data = torch.nn.utils.rnn.pad_sequence([torch.cat(p) for p in self.rows], batch_first=True)
        return data, torch.arange(data.shape[1], device=data.device).expand(len(self.rows), -1)
