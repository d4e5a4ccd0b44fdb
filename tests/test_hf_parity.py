"""Parity of kvgraft's runtime with transformers on tiny random Llama-family models.

Each case builds a transformers model from a tiny config, perturbs every parameter (so biases and norm
weights are not their trivial init), saves it with transformers' own save_pretrained, loads it with
kvgraft.hf.load_pretrained and compares logits; then decode, generation, cache size and round trip.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
import transformers

from kvgraft.hf import load_config, load_pretrained, save_pretrained
from kvgraft.model.rope import base_inv_freq
from kvgraft.runtime import generate

TINY = dict(
    vocab_size=100,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=64,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)

# case id -> (model_type, config overrides, sequence length)
CASES: dict[str, tuple[str, dict, int]] = {
    "llama_mha": ("llama", dict(num_key_value_heads=4), 16),
    "llama_gqa2": ("llama", dict(), 16),
    "llama_gqa4": ("llama", dict(hidden_size=64, num_attention_heads=8), 16),
    "llama_mqa": ("llama", dict(num_key_value_heads=1), 16),
    "llama_bias": ("llama", dict(attention_bias=True, mlp_bias=True), 16),
    "llama_tied": ("llama", dict(tie_word_embeddings=True), 16),
    "qwen2": ("qwen2", dict(), 16),
    "qwen2_tied": ("qwen2", dict(tie_word_embeddings=True), 16),
    "qwen3": ("qwen3", dict(head_dim=16), 16),
    "qwen3_bias": ("qwen3", dict(head_dim=16, attention_bias=True), 16),
    "mistral_sw": ("mistral", dict(sliding_window=8), 24),
    "qwen2_mixed": ("qwen2", dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=8, max_window_layers=1), 24),
    "qwen3_layer_types": (
        "qwen3",
        dict(head_dim=16, use_sliding_window=True, sliding_window=6, layer_types=["sliding_attention", "full_attention"]),
        24,
    ),
    "rope_linear": ("llama", dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}), 24),
    "rope_dynamic": (
        "llama",
        dict(max_position_embeddings=16, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}),
        24,
    ),
    "rope_llama3": (
        "llama",
        dict(
            hidden_size=64,
            max_position_embeddings=256,
            rope_parameters={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
                "rope_theta": 10000.0,
            },
        ),
        24,
    ),
    "rope_yarn": (
        "llama",
        dict(
            hidden_size=64,
            max_position_embeddings=64,
            rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0},
        ),
        24,
    ),
    "rope_yarn_mscale": (
        "llama",
        dict(
            hidden_size=64,
            max_position_embeddings=64,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 16,
                "mscale": 0.707,
                "mscale_all_dim": 1.0,
                "rope_theta": 10000.0,
            },
        ),
        24,
    ),
    "rope_yarn_options": (
        "llama",
        dict(
            hidden_size=64,
            max_position_embeddings=64,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 16,
                "beta_fast": 16.0,
                "beta_slow": 2.0,
                "truncate": False,
                "attention_factor": 1.3,
                "rope_theta": 500.0,
            },
        ),
        24,
    ),
}


def build_hf(model_type: str, overrides: dict, seed: int = 0):
    cfg = transformers.AutoConfig.for_model(model_type, **{**TINY, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():  # HF inits biases to 0 and norms to 1: make every parameter non-trivial
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """case id -> (hf model, its checkpoint dir, kvgraft model loaded from it); built once per case."""
    cache: dict = {}

    def get(case: str):
        if case not in cache:
            model_type, overrides, _ = CASES[case]
            hf = build_hf(model_type, overrides)
            path = tmp_path_factory.mktemp(case)
            hf.save_pretrained(path)
            cache[case] = (hf, path, load_pretrained(path))
        return cache[case]

    return get


def tokens(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(converted, case):
    hf, _, kv = converted(case)
    ids = tokens(2, CASES[case][2])
    with torch.no_grad():
        expected, got = hf(ids).logits, kv(ids)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() < 1e-4


def test_sliding_layer_types_mapped(converted):
    assert converted("mistral_sw")[2].config.layer_types == ("sliding_attention",) * 2
    assert converted("qwen2_mixed")[2].config.layer_types == ("full_attention", "sliding_attention", "sliding_attention")
    assert converted("qwen3_layer_types")[2].config.layer_types == ("sliding_attention", "full_attention")
    assert converted("qwen3_layer_types")[2].config.sliding_window == 6


def test_llama3_case_covers_every_frequency_band(converted):
    cfg = converted("rope_llama3")[2].config
    wavelen = 2 * math.pi / base_inv_freq(cfg.head_dim, cfg.rope.theta)
    old = cfg.rope.original_max_position_embeddings
    high, low = old / cfg.rope.high_freq_factor, old / cfg.rope.low_freq_factor
    assert (wavelen < high).any() and (wavelen > low).any() and ((wavelen >= high) & (wavelen <= low)).any()


@pytest.mark.parametrize("case", ["llama_gqa2", "llama_mqa", "mistral_sw", "qwen2_mixed", "qwen3", "rope_yarn_mscale"])
def test_incremental_decode_matches_full_forward(converted, case):
    kv = converted(case)[2]
    ids = tokens(2, 24, seed=2)
    with torch.no_grad():
        full = kv(ids)
        cache = kv.new_cache(2, 24)
        steps = [kv(ids[:, :10], cache=cache)]
        steps += [kv(ids[:, t : t + 1], cache=cache) for t in range(10, 24)]
    assert [cache.length(s) for s in cache.sequences] == [24, 24]
    assert (torch.cat(steps, dim=1) - full).abs().max().item() < 1e-5


@pytest.mark.parametrize("case", ["llama_gqa2", "qwen3", "mistral_sw", "rope_dynamic"])
def test_greedy_generate_matches_transformers(converted, case):
    """6 + 14 tokens: past the sliding window (8) and past rope_dynamic's max_position_embeddings (16)."""
    hf, _, kv = converted(case)
    ids = tokens(2, 6, seed=3)
    with torch.no_grad():
        expected = hf.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=14, min_new_tokens=14, pad_token_id=0
        )
    got = generate(kv, ids, max_new_tokens=14, temperature=0)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("case", ["llama_gqa4", "qwen3"])
def test_cache_bytes_per_token(converted, case):
    _, path, kv = converted(case)
    cfg = kv.config
    assert kv.new_cache(3, 32).bytes_per_token() == cfg.kv_bytes_per_token(4)  # 32 tokens: whole blocks
    bf16 = load_pretrained(path, dtype=torch.bfloat16)
    assert bf16.lm_head.weight.dtype == torch.bfloat16
    assert bf16.new_cache(3, 32).bytes_per_token() == cfg.kv_bytes_per_token(2)


@pytest.mark.parametrize(
    "case",
    ["llama_tied", "llama_bias", "qwen2_mixed", "qwen3_bias", "mistral_sw", "rope_llama3", "rope_yarn_options"],
)
def test_round_trip_through_transformers(converted, case, tmp_path):
    hf, _, kv = converted(case)
    model_type = CASES[case][0]
    out = save_pretrained(kv, tmp_path / "out", model_type=model_type)
    assert load_config(out) == kv.config
    hf2, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert type(hf2) is type(hf)
    reference = hf.state_dict()
    for name, tensor in hf2.state_dict().items():
        assert torch.equal(tensor, reference[name]), name
    ids = tokens(2, CASES[case][2], seed=4)
    with torch.no_grad():
        assert (hf2.eval()(ids).logits - hf(ids).logits).abs().max().item() <= 1e-6


def test_saved_checkpoint_loads_in_plain_transformers(converted, tmp_path):
    """from_pretrained in a fresh interpreter that never imports kvgraft."""
    out = save_pretrained(converted("llama_tied")[2], tmp_path / "out")
    script = (
        "import sys, transformers\n"
        f"m, info = transformers.AutoModelForCausalLM.from_pretrained({str(out)!r}, output_loading_info=True)\n"
        "assert not any(info[k] for k in ('missing_keys', 'unexpected_keys', 'mismatched_keys')), info\n"
        "assert 'kvgraft' not in sys.modules\n"
        "assert m.lm_head.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr()\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
