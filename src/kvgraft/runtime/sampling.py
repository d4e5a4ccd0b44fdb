"""Per-request sampling parameters and the sampler: greedy, temperature, top-p, seeded, stop conditions
(stop strings are matched by :mod:`kvgraft.runtime.stops`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvgraft.checks import check_int, is_int
from kvgraft.model import cpu_kernels


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops. Validated on construction (ValueError names the field).

    ``temperature`` 0 is greedy. ``seed`` makes sampling reproducible per request, whatever else is in the
    batch. Generation stops after ``max_new_tokens``, at any of ``stop_token_ids`` (kept in the output),
    or when the decoded output contains one of ``stop`` (needs the engine's ``detokenize``).
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_int("max_new_tokens", self.max_new_tokens, low=0, accepted="an integer >= 0")
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:
            raise ValueError(f"temperature ({self.temperature!r}) must be >= 0 (0 = greedy)")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p ({self.top_p!r}) must be in (0, 1]")
        if self.seed is not None and not is_int(self.seed):
            raise ValueError(f"seed ({self.seed!r}) must be an integer or None")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
        for t in self.stop_token_ids:
            if not is_int(t) or t < 0:
                raise ValueError(f"stop_token_ids must be token ids >= 0, got {t!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")


GREEDY_BELOW = 1e-6


def sample_next(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> torch.Tensor:
    """logits (B, V) -> next token ids (B,). temperature 0 means greedy, and so does any temperature below
    ``GREEDY_BELOW`` (its limit: logits / 1e-40 overflow fp32 and softmax would give NaN)."""
    if temperature < 0:
        raise ValueError(f"temperature ({temperature}) must be >= 0")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p ({top_p}) must be in (0, 1]")
    if temperature < GREEDY_BELOW:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop = sorted_p.cumsum(dim=-1) - sorted_p >= top_p
        drop[..., 0] = False  # even when top_p rounds to 0 in fp32
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


class Sampler:
    """The next token of each row of one step's logits (rows, vocab), each with its own parameters and
    generator: greedy rows take the argmax (computed once for all rows), the others :func:`sample_next`."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits
        self._greedy: list[int] | None = None

    def token(self, row: int, params: SamplingParams, generator: torch.Generator | None) -> int:
        if params.temperature == 0:
            if self._greedy is None:
                self._greedy = cpu_kernels.argmax(self.logits).tolist()
            return self._greedy[row]
        return int(sample_next(self.logits[row : row + 1], params.temperature, params.top_p, generator)[0])
