"""Named model configs: the shipped reference models' shapes and tiny shapes for tests."""

from __future__ import annotations

from kvgraft.model.config import ModelConfig, RopeConfig

PRESETS: dict[str, ModelConfig] = {
    # The shipped reference model (models/kvgraft-llama-8m): Llama architecture with 2:1 GQA.
    "llama-8m": ModelConfig(
        vocab_size=8192, hidden_size=256, num_layers=8, num_heads=8, num_kv_heads=4, head_dim=32,
        intermediate_size=688, max_position_embeddings=512, rms_norm_eps=1e-5,
        rope=RopeConfig(theta=10000.0), tie_word_embeddings=True, bos_token_id=0, eos_token_id=0,
    ),
    # A few-second model for tests and smoke runs.
    "llama-tiny": ModelConfig(
        vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
        intermediate_size=128, max_position_embeddings=128, rms_norm_eps=1e-5,
    ),
}


def get_preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known presets: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]
