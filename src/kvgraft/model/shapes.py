"""The model's parameter shapes, in one place: read off the model itself, built on the meta device.

Every other place that needs them (the checkpoint key check in :mod:`kvgraft.hf.keys`, parameter counts
in model cards and ``doctor``) asks here instead of keeping its own table, so a new parameter in the
runtime cannot disagree with the loader or the counts. Building on ``torch.device("meta")`` allocates
nothing and runs no initialisation arithmetic, so this is cheap even for a 70B config.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from kvgraft.model.config import ModelConfig
from kvgraft.model.transformer import Transformer

LM_HEAD = "lm_head.weight"


@lru_cache(maxsize=64)
def _meta_summary(config: ModelConfig) -> tuple[tuple[tuple[str, tuple[int, ...]], ...], int]:
    with torch.device("meta"):
        model = Transformer(config)
    shapes = tuple(
        (key, tuple(t.shape)) for key, t in model.state_dict().items() if not (config.tie_word_embeddings and key == LM_HEAD)
    )
    count = sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once
    return shapes, count


def parameter_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """State-dict key -> shape of ``Transformer(config)`` (kvgraft's names, e.g. ``layers.0.self_attn.q_proj.weight``).

    With ``tie_word_embeddings`` there is no ``lm_head.weight`` (it is ``embed_tokens.weight``, and
    checkpoints carry it once). Non-persistent buffers (RoPE frequencies) are not state and not listed.
    """
    return dict(_meta_summary(config)[0])


def num_parameters(config: ModelConfig) -> int:
    """The number of parameters of ``Transformer(config)``, each counted once (tied embeddings once)."""
    return _meta_summary(config)[1]


__all__ = ["num_parameters", "parameter_shapes"]
