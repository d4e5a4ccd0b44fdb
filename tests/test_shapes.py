"""kvgraft.model.shapes: the parameter shapes and count, read off the model built on the meta device."""

from __future__ import annotations

import pytest

from kvgraft.hf.keys import expected_shapes
from kvgraft.model.config import ModelConfig
from kvgraft.model.presets import get_preset
from kvgraft.model.shapes import num_parameters, parameter_shapes
from kvgraft.model.transformer import Transformer

MLA = ModelConfig(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    attention_kinds=("mla", "gqa"),
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    mla_latent_norm=True,
    qkv_bias=True,
)
CONFIGS = {
    "llama-tied": get_preset("llama-tiny"),
    "llama-untied-biases-qk-norm": get_preset("llama-tiny").replace(
        tie_word_embeddings=False, qkv_bias=True, o_bias=True, mlp_bias=True, qk_norm=True
    ),
    "mla": MLA,
    "mla-qk-norm": MLA.replace(qk_norm=True, head_dim=16),
    "ced": get_preset("ced-tiny"),
    "ced-indexer-tied": get_preset("ced-tiny").replace(index_topk=4, index_heads=2, index_head_dim=8, tie_word_embeddings=True),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_shapes_and_count_match_a_real_model(name):
    cfg = CONFIGS[name]
    model = Transformer(cfg)
    state = {k: tuple(v.shape) for k, v in model.state_dict().items() if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    assert parameter_shapes(cfg) == state
    assert ("lm_head.weight" in state) == (not cfg.tie_word_embeddings)
    assert num_parameters(cfg) == sum(p.numel() for p in model.parameters())
    assert expected_shapes(cfg) == state  # the checkpoint check uses the same table


def test_the_result_is_a_fresh_dict():
    cfg = CONFIGS["llama-tied"]
    parameter_shapes(cfg).clear()
    assert parameter_shapes(cfg)


def test_a_large_config_costs_no_memory():
    cfg = get_preset("llama-8m").replace(
        num_layers=80,
        hidden_size=8192,
        intermediate_size=28672,
        num_heads=64,
        num_kv_heads=8,
        head_dim=128,
        vocab_size=128256,
        tie_word_embeddings=False,
    )
    assert num_parameters(cfg) == 70_553_706_496  # Llama-3-70B
    assert parameter_shapes(cfg)["lm_head.weight"] == (128256, 8192)
