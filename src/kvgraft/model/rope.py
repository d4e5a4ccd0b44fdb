"""Rotary position embeddings with the scaling kinds transformers uses for the Llama family.

Layout is the "rotate-half" one of Llama/Qwen/Mistral: a head vector's first half pairs with its
second half, frequency ``i`` rotates dims ``(i, i + d/2)``.

The formulas follow transformers' ``modeling_rope_utils`` (default, linear, dynamic NTK, llama3, yarn);
the parity tests compare them against it. Dynamic NTK is stateless here: the frequencies of a forward
call are those of its largest position (clamped below at ``max_position_embeddings``), which is what
transformers computes for a fresh model and for monotonically growing decode.
"""

from __future__ import annotations

import math

import torch

from kvgraft.errors import ConfigError
from kvgraft.model import cpu_kernels
from kvgraft.model.config import ModelConfig, RopeConfig


def base_inv_freq(dim: int, theta: float) -> torch.Tensor:
    """(dim/2,) inverse frequencies ``theta ** (-2i/dim)`` in fp32."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _needed(rope: RopeConfig, name: str) -> float:
    """RoPE field ``name``, which ``rope.rope_type`` needs (RopeConfig validated it is set)."""
    value: float | None = getattr(rope, name)
    if value is None:
        raise ConfigError(f"rope_type {rope.rope_type!r} needs {name}")
    return value


def rope_frequencies(
    rope: RopeConfig, dim: int, max_position_embeddings: int, seq_len: int | None = None
) -> tuple[torch.Tensor, float]:
    """Return ``(inv_freq (dim/2,), attention_scaling)`` for one RoPE config.

    ``seq_len`` matters only for ``dynamic`` (the current context length).
    """
    kind = rope.rope_type
    inv_freq = base_inv_freq(dim, rope.theta)
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / _needed(rope, "factor"), 1.0
    if kind == "dynamic":
        factor = _needed(rope, "factor")
        seq_len = max(seq_len or max_position_embeddings, max_position_embeddings)
        base = rope.theta * ((factor * seq_len / max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))
        return base_inv_freq(dim, base), 1.0
    if kind == "llama3":
        factor, old_len = _needed(rope, "factor"), _needed(rope, "original_max_position_embeddings")
        low, high = _needed(rope, "low_freq_factor"), _needed(rope, "high_freq_factor")
        low_wavelen = old_len / low
        high_wavelen = old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        return _yarn(rope, dim, max_position_embeddings)
    raise ConfigError(f"unknown rope_type {kind!r}")


def _yarn(rope: RopeConfig, dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    # YaRN (arXiv:2309.00071): interpolate low frequencies, extrapolate high ones, ramp between.
    original = rope.original_max_position_embeddings or max_position_embeddings
    factor = rope.factor if rope.factor is not None else max_position_embeddings / original

    def mscale_of(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = mscale_of(factor, rope.mscale) / mscale_of(factor, rope.mscale_all_dim)
        else:
            attention_factor = mscale_of(factor)
    beta_fast = rope.beta_fast or 32
    beta_slow = rope.beta_slow or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # share of extrapolation per frequency
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


class RotaryEmbedding(torch.nn.Module):
    """Computes cos/sin tables for given positions; holds no learned state."""

    inv_freq: torch.Tensor  # a non-persistent buffer

    def __init__(self, config: ModelConfig, dim: int | None = None) -> None:
        super().__init__()
        self.rope = config.rope
        self.dim = dim or config.head_dim
        self.max_position_embeddings = config.max_position_embeddings
        inv_freq, scaling = rope_frequencies(self.rope, self.dim, self.max_position_embeddings)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attention_scaling = scaling

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (B, T) int -> cos, sin (B, T, dim) in ``dtype``."""
        inv_freq, scaling = self.inv_freq, self.attention_scaling
        if self.rope.rope_type == "dynamic":
            seq_len = int(positions.max()) + 1
            if seq_len > self.max_position_embeddings:
                inv_freq, scaling = rope_frequencies(self.rope, self.dim, self.max_position_embeddings, seq_len)
                inv_freq = inv_freq.to(positions.device)
        freqs = positions[..., None].float() * inv_freq.float()  # (B, T, dim/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (B, T, dim)
        return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fused: bool = False) -> torch.Tensor:
    """x (B, nh, T, d), cos/sin (B, T, d) -> rotated x. ``fused``: kvgraft's one-pass CPU kernel where it applies
    (float32 inference; bit-identical), torch's ops otherwise."""
    if fused:
        y = cpu_kernels.rope(x, cos, sin)
        if y is not None:
            return y
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


def apply_rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fused: bool = False) -> torch.Tensor:
    """:func:`apply_rope` written into ``x`` (a view into a larger buffer stays one: no copy, no concatenation
    after); ``x`` must not need a gradient. ``fused``: kvgraft's kernel rotates it in place where it applies."""
    if not (fused and cpu_kernels.rope_(x, cos, sin)):
        x.copy_(apply_rope(x, cos, sin))
    return x
