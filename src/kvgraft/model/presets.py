"""Named model configs: the shipped reference models' shapes and tiny shapes for tests."""

from __future__ import annotations

from kvgraft.errors import ConfigError
from kvgraft.model.config import ModelConfig, RopeConfig

PRESETS: dict[str, ModelConfig] = {
    # The shipped reference model (models/kvgraft-llama-8m): Llama architecture with 2:1 GQA.
    "llama-8m": ModelConfig(
        vocab_size=8192,
        hidden_size=256,
        num_layers=8,
        num_heads=8,
        num_kv_heads=4,
        head_dim=32,
        intermediate_size=688,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope=RopeConfig(theta=10000.0),
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
    ),
    # The shipped reference causal encoder-decoder (models/kvgraft-ced-8m): the Llama reference's data,
    # tokenizer and width; kv_source layers 1, 3 and pivot 4, window 64, shared entries pool 2 tokens.
    "ced-8m": ModelConfig(
        vocab_size=8192,
        hidden_size=256,
        num_layers=8,
        num_heads=8,
        num_kv_heads=4,
        head_dim=32,
        intermediate_size=688,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope=RopeConfig(theta=10000.0),
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
        kv_source_layers=(1, 3, 4),
        sliding_window=64,
        compress_rate=2,
        kv_lora_rank=64,
        qk_rope_head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=32,
        mla_latent_norm=True,
    ),
    # The deeper reference causal encoder-decoder (models/kvgraft-ced-8m-deep, issue 25): ced-8m's data,
    # tokenizer, width, heads, window and shared-KV shape at twice the depth (16 layers, pivot 8 in the
    # middle; kv_source layers 2, 6, 8 are ced-8m's 1, 3, 4 doubled) and about the same parameter count
    # (8.18M vs 8.20M): the MLP narrows from 688 to 200 to pay for the extra layers.
    "ced-8m-deep": ModelConfig(
        vocab_size=8192,
        hidden_size=256,
        num_layers=16,
        num_heads=8,
        num_kv_heads=4,
        head_dim=32,
        intermediate_size=200,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope=RopeConfig(theta=10000.0),
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
        kv_source_layers=(2, 6, 8),
        sliding_window=64,
        compress_rate=2,
        kv_lora_rank=64,
        qk_rope_head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=32,
        mla_latent_norm=True,
    ),
    # A few-second model for tests and smoke runs.
    "llama-tiny": ModelConfig(
        vocab_size=512,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
    ),
    "ced-tiny": ModelConfig(
        vocab_size=512,
        hidden_size=64,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=128,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        kv_source_layers=(1, 2),
        sliding_window=8,
        compress_rate=2,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
    ),
}


def get_preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; known presets: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]
