"""Shapes the benchmarks share: a randomly initialised model of 1B-parameter (Llama-3.2-1B-like) shape."""

from __future__ import annotations

import torch

from kvgraft.model import ModelConfig, Transformer


def one_b_config(layers: int = 16) -> ModelConfig:
    """hidden 2048, 32 query / 8 KV heads of 64, SwiGLU 8192, vocab 32000, tied: 1.1B parameters at 16 layers."""
    return ModelConfig(
        vocab_size=32000,
        hidden_size=2048,
        num_layers=layers,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        intermediate_size=8192,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope={"theta": 500000.0},
        tie_word_embeddings=True,
    )


def random_model(device: str = "cpu", layers: int = 16, seed: int = 0) -> Transformer:
    """Built on the meta device, materialised on ``device`` and initialised (no double allocation)."""
    with torch.device("meta"):
        model = Transformer(one_b_config(layers))
    model = model.to_empty(device=device)
    if model.config.tie_word_embeddings:  # to_empty gives each module its own tensor: tie them again
        model.lm_head.weight = model.embed_tokens.weight
    model.rotary = type(model.rotary)(model.config).to(device)
    model.init_weights(seed)
    return model.eval()
