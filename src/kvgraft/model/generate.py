"""Batched prefill then incremental decode over one preallocated cache; greedy, temperature, top-p."""

from __future__ import annotations

import torch

from kvgraft.model.transformer import Transformer


def sample_next(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None
) -> torch.Tensor:
    """logits (B, V) -> next token ids (B,). temperature 0 means greedy."""
    if temperature < 0:
        raise ValueError(f"temperature ({temperature}) must be >= 0")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p ({top_p}) must be in (0, 1]")
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop = sorted_p.cumsum(dim=-1) - sorted_p >= top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.inference_mode()
def generate(
    model: Transformer,
    input_ids: torch.Tensor,  # (B, T) prompts of equal length
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
    eos_token_id: int | None = None,
) -> torch.Tensor:
    """Return (B, T + n) token ids; rows that emitted ``eos_token_id`` are padded with it afterwards."""
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be (batch, length>0), got shape {tuple(input_ids.shape)}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens ({max_new_tokens}) must be >= 0")
    B, T = input_ids.shape
    generator = None
    if seed is not None:
        generator = torch.Generator(device=input_ids.device).manual_seed(seed)
    cache = model.new_cache(B, T + max_new_tokens)
    logits = model(input_ids, cache=cache, last_only=True)[:, -1]
    out = [input_ids]
    done = torch.zeros(B, dtype=torch.bool, device=input_ids.device)
    for step in range(max_new_tokens):
        nxt = sample_next(logits, temperature, top_p, generator)
        if eos_token_id is not None:
            nxt = torch.where(done, torch.full_like(nxt, eos_token_id), nxt)
            done |= nxt == eos_token_id
        out.append(nxt[:, None])
        if step == max_new_tokens - 1 or (eos_token_id is not None and bool(done.all())):
            break
        logits = model(nxt[:, None], cache=cache)[:, -1]
    return torch.cat(out, dim=1)
