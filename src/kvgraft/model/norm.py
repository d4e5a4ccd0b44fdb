"""RMSNorm exactly as the Llama family computes it."""

from __future__ import annotations

import torch
from torch import nn

from kvgraft.model import cpu_kernels


class RMSNorm(nn.Module):
    """Llama's RMSNorm: normalise in fp32, cast back, then scale (bit-compatible with transformers)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        """``fused``: kvgraft's one-pass CPU kernel where it applies (float32 inference; the sum of squares in
        another order, so not bit for bit); torch's ops otherwise."""
        if fused:
            y = cpu_kernels.rms_norm(x, self.weight, self.eps)
            if y is not None:
                return y
        return self._norm(x)

    def add_forward(self, x: torch.Tensor, a: torch.Tensor, fused: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x + a, self(x + a))``: a residual add and this norm; ``fused``: in one pass where kvgraft's CPU
        kernel applies (as :meth:`forward`'s)."""
        if fused:
            pair = cpu_kernels.add_rms_norm(x, a, self.weight, self.eps)
            if pair is not None:
                return pair
        s = x + a
        return s, self._norm(s)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)
