"""Generation for a batch of equal-length prompts, through the continuous-batching engine (:mod:`kvgraft.runtime.engine`)."""

from __future__ import annotations

import math

import torch

from kvgraft.checks import check_int
from kvgraft.model.sizes import default_block_size
from kvgraft.model.transformer import Transformer
from kvgraft.runtime.engine import Engine
from kvgraft.runtime.options import EngineOptions
from kvgraft.runtime.sampling import SamplingParams

__all__ = ["generate"]


@torch.inference_mode()
def generate(
    model: Transformer,
    input_ids: torch.Tensor,  # (B, T) prompts of equal length
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
    eos_token_id: int | None = None,
    block_size: int | None = None,
) -> torch.Tensor:
    """Return (B, T + n) token ids; rows that emitted ``eos_token_id`` are padded with it afterwards.

    Each row is one engine request (row r samples with seed ``seed + r``), so a row's tokens do not
    depend on the others in the batch."""
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be (batch, length>0), got shape {tuple(input_ids.shape)}")
    check_int("max_new_tokens", max_new_tokens, low=0, accepted="an integer >= 0")
    params = [
        SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=None if seed is None else seed + r,
            stop_token_ids=() if eos_token_id is None else (eos_token_id,),
        )
        for r in range(input_ids.shape[0])
    ]
    if max_new_tokens == 0:
        return input_ids.clone()
    B, T = input_ids.shape
    total = T + max_new_tokens
    block_size = default_block_size(model.config) if block_size is None else block_size
    engine = Engine(
        model,
        EngineOptions(
            num_blocks=B * math.ceil(total / block_size),
            block_size=block_size,
            max_seqs=B,
            max_batch_tokens=max(B * T, 256),
            max_seq_len=total,
        ),
    )
    outs = engine.generate(input_ids.tolist(), params)
    width = max(len(o) for o in outs)
    pad = eos_token_id if eos_token_id is not None else 0
    rows = [o + [pad] * (width - len(o)) for o in outs]
    return torch.cat([input_ids, torch.tensor(rows, dtype=input_ids.dtype, device=input_ids.device)], dim=1)
