"""What a layer-by-layer graft measures of one original layer over the calibration hidden states: the
attention input's second moment, linear stand-ins for Qwen3's q/k norms, the attention-distance profile and
the RoPE expectation it gives, and the block's output (what feeds the next layer)."""

from __future__ import annotations

from typing import cast

import torch

from kvgraft.errors import ConfigError
from kvgraft.model.batch import DenseContext
from kvgraft.model.fields import known
from kvgraft.model.norm import RMSNorm
from kvgraft.model.rope import apply_rope
from kvgraft.model.transformer import Block, GQAttention

__all__ = [
    "distance_profile",
    "gqa",
    "linearised",
    "linearised_keys",
    "rope_expectation",
    "run_block",
    "second_moment",
    "shrink_second_moment",
]


def gqa(block: Block) -> GQAttention:
    """The block's attention, a GQA one (what the graft reads)."""
    return cast(GQAttention, block.self_attn)


def shrink_second_moment(C: torch.Tensor | None, shrinkage: float) -> torch.Tensor | None:
    """``(1 - s) C + s (tr C / h) I``: the calibrated second moment pulled toward the isotropic one of the
    weights-only fit, at the same total energy (``s = 0`` returns ``C`` itself)."""
    if C is None or not shrinkage:
        return C
    h = C.shape[0]
    iso = torch.eye(h, dtype=C.dtype, device=C.device) * (torch.diagonal(C).sum() / h)
    return (1.0 - shrinkage) * C + shrinkage * iso


def second_moment(norm: RMSNorm, x: torch.Tensor, batch_size: int) -> torch.Tensor:
    """E[x x^T] (fp64) of the attention input ``norm(x)`` over every calibration token."""
    h = x.shape[-1]
    C = torch.zeros(h, h, dtype=torch.float64, device=x.device)
    n = 0
    for start in range(0, x.shape[0], batch_size):
        a = norm(x[start : start + batch_size]).reshape(-1, h).double()
        C += a.T @ a
        n += a.shape[0]
    return (C / n).cpu()


def linearised_keys(block: Block, x: torch.Tensor | None, C: torch.Tensor | None, batch_size: int) -> torch.Tensor:
    """The linear stand-in for Qwen3's keys (see :func:`linearised`)."""
    return linearised(block, "k", x, C, batch_size)


def linearised(block: Block, which: str, x: torch.Tensor | None, C: torch.Tensor | None, batch_size: int) -> torch.Tensor:
    """A linear stand-in (heads*d, h) for Qwen3's keys k = k_norm(W_k x) (``which="k"``) or queries
    q = q_norm(W_q x) (``"q"``), which MLA's latent (or the share graft's window) must produce linearly.

    With calibration (``x`` and its second moment ``C``): the least-squares map E[k x^T] E[x x^T]^-1 over the
    calibration tokens. Weights only: each head's rows scaled by the norm's weight over the head's typical RMS
    for isotropic x.
    """
    attn = gqa(block)
    proj, norm = (attn.k_proj, attn.k_norm) if which == "k" else (attn.q_proj, attn.q_norm)
    w_k = proj.weight.detach().double()
    gamma = norm.weight.detach().double()
    d = gamma.shape[0]
    K = w_k.shape[0] // d
    if x is None:
        heads = w_k.view(K, d, -1)
        rms = heads.pow(2).sum(dim=(1, 2)).div(d).sqrt()  # E||W_j x||^2 / d with E[x x^T] = I
        return (heads * gamma[None, :, None] / rms[:, None, None]).reshape(K * d, -1).cpu()
    h = x.shape[-1]
    R = torch.zeros(K * d, h, dtype=torch.float64, device=x.device)
    n = 0
    for start in range(0, x.shape[0], batch_size):
        a = block.input_layernorm(x[start : start + batch_size]).reshape(-1, h)
        k = norm(proj(a).view(a.shape[0], K, d)).reshape(a.shape[0], K * d)
        R += k.double().T @ a.double()
        n += a.shape[0]
    R = (R / n).cpu()
    if C is None:
        raise ConfigError("the least-squares fit of the q/k norm needs the inputs' second moment C with x")
    ridge = 1e-6 * torch.diagonal(C).mean()
    fit: torch.Tensor = torch.linalg.solve(C + ridge * torch.eye(h, dtype=C.dtype), R.T).T
    return fit


def distance_profile(block: Block, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch_size: int) -> torch.Tensor:
    """(T,) how much attention the original layer pays at each distance delta = query pos - key pos.

    Averaged over heads, queries and calibration sequences; each query's weights sum to one. Computed one
    KV group at a time (its query heads side by side on the query axis, the group's key head not repeated):
    the (B, H/K x T, T) probabilities are summed over batch and heads in fp32 into a (T, T) fp64 total, and
    the total's diagonals are read off once at the end.
    """

    attn = gqa(block)
    H, K, d = attn.num_heads, attn.num_kv_heads, known(attn.head_dim, "head_dim")
    group = H // K
    T = x.shape[1]
    delta = torch.arange(T, device=x.device)[:, None] - torch.arange(T, device=x.device)[None, :]  # (T, T)
    allowed = delta >= 0
    if attn.window is not None:
        allowed &= delta < attn.window
    blocked = ~allowed
    total = torch.zeros(T, T, dtype=torch.float64, device=x.device)
    n = 0
    for start in range(0, x.shape[0], batch_size):
        sl = slice(start, start + batch_size)
        a = block.input_layernorm(x[sl])
        B = a.shape[0]
        q = attn.q_proj(a).view(B, T, H, d)
        k = attn.k_proj(a).view(B, T, K, d)
        if attn.qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos[sl], sin[sl]) * d**-0.5  # (B, H, T, d), softmax scale folded in
        k = apply_rope(k.transpose(1, 2), cos[sl], sin[sl])  # (B, K, T, d)
        for j in range(K):
            qg = q[:, j * group : (j + 1) * group].reshape(B, group * T, d)
            logits = torch.bmm(qg, k[:, j].transpose(-1, -2)).view(B, group, T, T)
            logits.masked_fill_(blocked, float("-inf"))
            total += torch.softmax(logits, dim=-1).sum(dim=(0, 1))
        n += B * H * T
    profile = torch.zeros(T, dtype=torch.float64, device=x.device)
    profile.index_add_(0, delta[allowed], total[allowed])
    return (profile / n).cpu()


def rope_expectation(profile: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """(d/2, 2): per frequency, E[cos(delta theta)] and E[sin(delta theta)] under the distance profile."""
    angles = torch.arange(len(profile), dtype=torch.float64)[:, None] * inv_freq[None, :]  # (T, d/2)
    return torch.stack([(profile[:, None] * angles.cos()).sum(0), (profile[:, None] * angles.sin()).sum(0)], dim=-1)


def run_block(
    block: Block, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch_size: int, single_rows: int = 0
) -> torch.Tensor:
    """``block``'s output for hidden states ``x`` (positions 0..T-1; RoPE ``cos``/``sin``), ``batch_size``
    sequences at a time; the last ``single_rows`` sequences one at a time (``TAIL_ROWS``)."""
    n = x.shape[0]
    split = n - min(single_rows, n)
    bounds = [(s, min(s + batch_size, split)) for s in range(0, split, batch_size)] + [(s, s + 1) for s in range(split, n)]
    out = []
    for start, end in bounds:
        sl = slice(start, end)
        xs = x[sl]
        positions = torch.arange(xs.shape[1], device=xs.device).expand(xs.shape[0], -1)
        out.append(block(xs, cos[sl], sin[sl], DenseContext(positions, default_positions=True)))
    return torch.cat(out)
