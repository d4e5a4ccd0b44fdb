"""Decode-step attention over a cache, without repeating shared key/value heads.

For a few new tokens against a long cache, plain matmuls with the query heads of a group folded
into the query axis beat ``scaled_dot_product_attention`` on the CPU (which, with ``enable_gqa``,
expands K/V per query head); the result is the same (tested against it).

The score matrix (query heads x keys, fp32) is the only large temporary of a step, so it is touched as
few times as possible: the softmax scale multiplies the (small) query before the matmul, and the mask is
applied in place, broadcast over the heads of a group (no repeated copy of the mask, no scaled copy).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

# Steps adding at most this many tokens to a cache use grouped_attention; longer ones use SDPA.
DECODE_MAX_NEW_TOKENS = 16


def grouped_attention(
    q: torch.Tensor,  # (B, H, T, D)
    k: torch.Tensor,  # (B, K, S, D), K divides H; query head h reads key head h // (H / K)
    v: torch.Tensor,  # (B, K, S, Dv)
    mask: torch.Tensor | None,  # (T, S) or (B, T, S) bool, True = attend; None = every key visible
    scale: float,
) -> torch.Tensor:
    """Softmax attention, (B, H, T, Dv); scores and softmax in fp32."""
    B, H, T, D = q.shape
    K = k.shape[1]
    G = H // K
    qg = (q * scale).reshape(B, K, G * T, D)  # heads of one group side by side on the query axis
    scores = torch.matmul(qg, k.transpose(-1, -2)).float()  # (B, K, G*T, S)
    if mask is not None:  # in place, broadcast over the G heads of a group: (.., K, G, T, S)
        blocked = ~mask if mask.dim() == 2 else (~mask)[:, None, None]
        scores.view(B, K, G, T, -1).masked_fill_(blocked, float("-inf"))
    p = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(p, v).view(B, K, G, T, -1).reshape(B, H, T, -1)


def grouped_attention_head_major(
    q: torch.Tensor,  # (G, H, T, D)
    k: torch.Tensor,  # (K, G, S, D): each head's keys contiguous (the paged cache's GQA layout)
    v: torch.Tensor,  # (K, G, S, Dv)
    mask: torch.Tensor | None,  # (G, T, S) bool, True = attend; None = every key visible
    scale: float,
) -> torch.Tensor:
    """``grouped_attention`` over head-major keys/values: the (small) queries are rearranged instead of
    the cache, so the step reads each head's keys in place. Returns (G, H, T, Dv); fp32 softmax."""
    G, H, T, D = q.shape
    K = k.shape[0]
    R = H // K
    qk = (q * scale).reshape(G, K, R * T, D).transpose(0, 1)  # (K, G, R*T, D)
    scores = torch.matmul(qk, k.transpose(-1, -2)).float()  # (K, G, R*T, S)
    if mask is not None:
        scores.view(K, G, R, T, -1).masked_fill_((~mask)[None, :, None], float("-inf"))  # broadcast over K, R
    p = torch.softmax(scores, dim=-1).to(v.dtype)
    y = torch.matmul(p, v)  # (K, G, R*T, Dv)
    return y.transpose(0, 1).reshape(G, K, R, T, -1).reshape(G, H, T, -1)


def grouped_attention_strided(
    q: torch.Tensor,  # (G, H, T, D)
    k: torch.Tensor,  # (K, G, S, D): head-major, any stride between rows (views of the pools' home runs)
    v: torch.Tensor,  # (K, G, S, Dv)
    mask: torch.Tensor,  # (G, T, S) bool, True = attend
    scale: float,
) -> torch.Tensor:
    """``grouped_attention_head_major`` over keys/values whose rows are strided views rather than one
    contiguous batch: one batched matmul per key head (a batch of rows at a fixed stride is what a batched
    matmul reads in place; the 4-d matmul would copy the keys to flatten heads and rows). Returns
    (G, H, T, Dv); fp32 softmax."""
    G, H, T, D = q.shape
    K = k.shape[0]
    R = H // K
    qk = (q * scale).reshape(G, K, R * T, D)
    blocked = (~mask)[:, None]  # (G, 1, T, S): broadcast over a key head's R query heads
    y = []
    for h in range(K):  # a loop over key heads (few), not rows
        scores = torch.bmm(qk[:, h], k[h].transpose(1, 2)).float()  # (G, R*T, S)
        scores.view(G, R, T, -1).masked_fill_(blocked, float("-inf"))
        p = torch.softmax(scores, dim=-1).to(v.dtype)
        y.append(torch.bmm(p, v[h]))  # (G, R*T, Dv)
    return torch.stack(y, dim=1).view(G, K, R, T, -1).reshape(G, H, T, -1)


def head_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a (G, K, M, X) @ b (G, K, X, N)`` without copying ``b`` when its rows and heads do not share one
    stride (a window read as (G, S, K, d) entries, whose heads sit side by side in a row): one batched
    matmul per head then, where ``torch.matmul`` would first copy ``b`` to flatten the two batch axes."""
    K = b.shape[1]
    if K == 1 or b.stride(0) == K * b.stride(1):
        return torch.matmul(a, b)
    return torch.stack([torch.bmm(a[:, h], b[:, h]) for h in range(K)], dim=1)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` that keeps the CPU's fused kernel when the value width differs from
    the query/key width (latent attention: d_nope + d_rope vs d_v). That kernel needs equal widths; otherwise
    SDPA falls back to its math path, which materialises the scores (measured 2-3x slower at the reference
    models' prefill shapes). Zero columns on the narrower side change nothing but rounding. Only without
    autograd on the CPU (the padded copy would otherwise join the graph); ``scale`` must be given when the
    query/key side is padded, since SDPA's default reads the width."""
    pad = q.shape[-1] - v.shape[-1]
    if pad and q.device.type == "cpu" and not torch.is_grad_enabled():
        if pad > 0:
            return F.scaled_dot_product_attention(q, k, F.pad(v, (0, pad)), **kwargs)[..., : v.shape[-1]]
        if kwargs.get("scale") is None:
            kwargs["scale"] = q.shape[-1] ** -0.5
        return F.scaled_dot_product_attention(F.pad(q, (0, -pad)), F.pad(k, (0, -pad)), v, **kwargs)
    return F.scaled_dot_product_attention(q, k, v, **kwargs)


def attention_over_pieces(
    q: torch.Tensor,  # (1, H, T, D): one row's queries
    keys: list[torch.Tensor],  # pieces of the row's cache in position order, each (K, 1, S_i, D)
    values: list[torch.Tensor],  # the same pieces' values, each (K, 1, S_i, Dv)
    scale: float,
) -> torch.Tensor:
    """Softmax attention of one row over its cache held in several pieces (views of consecutive blocks),
    every key visible, without concatenating the pieces: the scores ((K, R*T, S) with R = H/K query heads
    per key head, far smaller than the keys) are joined instead, and the values are summed piece by piece.
    Returns (1, H, T, Dv); fp32 softmax. One piece: ``grouped_attention_head_major`` without a mask."""
    _, H, T, D = q.shape
    K = keys[0].shape[0]
    R = H // K
    qk = (q * scale).reshape(1, K, R * T, D).transpose(0, 1)  # (K, 1, R*T, D)
    scores = torch.cat([torch.matmul(qk, k.transpose(-1, -2)) for k in keys], dim=-1).float()  # (K, 1, R*T, S)
    p = torch.softmax(scores, dim=-1).to(values[0].dtype)
    parts = torch.split(p, [k.shape[2] for k in keys], dim=-1)
    y = torch.matmul(parts[0], values[0])
    for part, v in zip(parts[1:], values[1:]):
        y = y + torch.matmul(part, v)
    return y.transpose(0, 1).reshape(1, K, R, T, -1).reshape(1, H, T, -1)


def last_positions(pieces: list[torch.Tensor], n: int | None, dim: int) -> list[torch.Tensor]:
    """The pieces (in position order) cut to their last ``n`` positions along ``dim`` (None: all)."""
    if n is None:
        return pieces
    out: list[torch.Tensor] = []
    for piece in reversed(pieces):
        if n <= 0:
            break
        size = piece.shape[dim]
        out.append(piece.narrow(dim, max(0, size - n), min(size, n)))
        n -= size
    return out[::-1]
