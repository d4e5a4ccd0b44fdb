"""Decode-step attention over a cache, without repeating shared key/value heads.

For a few new tokens against a long cache, plain matmuls with the query heads of a group folded
into the query axis beat ``scaled_dot_product_attention`` on the CPU (which, with ``enable_gqa``,
expands K/V per query head); the result is the same (tested against it).
"""

from __future__ import annotations

import torch

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
    qg = q.reshape(B, K, G * T, D)  # heads of one group side by side on the query axis
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scale  # (B, K, G*T, S)
    if mask is not None:
        mask = mask.repeat(G, 1) if mask.dim() == 2 else mask.repeat(1, G, 1)[:, None]  # (.., G*T, S)
        scores = scores.masked_fill(~mask, float("-inf"))
    p = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(p, v).view(B, K, G, T, -1).reshape(B, H, T, -1)
