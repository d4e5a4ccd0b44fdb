"""kvgraft.graft.doctor: the pre-conversion check-up, from in-memory configs and from config.json alone."""

from __future__ import annotations

import dataclasses
import json

import pytest

from kvgraft.errors import CheckpointError
from kvgraft.graft.doctor import (
    DoctorReport,
    attention_kind,
    default_kv_lora_rank,
    doctor,
    format_kv_cache_table,
    kv_cache_table,
)
from kvgraft.hf.config_map import kvgraft_config_dict
from kvgraft.model.config import ModelConfig, RopeConfig
from kvgraft.model.shapes import num_parameters


def _cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=64, hidden_size=64, num_layers=2, num_heads=8, num_kv_heads=2, intermediate_size=96)
    return ModelConfig(**(base | kw))


def _write(tmp_path, name: str, d: dict):
    directory = tmp_path / name
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(d), encoding="utf-8")
    return directory


HF_COMMON = dict(vocab_size=64, intermediate_size=96, hidden_act="silu", rms_norm_eps=1e-6)


# ---- the seed's KV-cache table ----------------------------------------------------------------------

SEED_BEFORE = 28 * 2 * 32 * 128 * 2  # MHA, 28 layers, 32 heads x 128, keys + values, bf16: 458,752 B/token
SEED_AFTER = 28 * 1024 * 2  # latent d_c = 1024 only (the seed's "after" leaves out d_rope): 57,344 B/token


def test_seed_table_from_a_config():
    seed = ModelConfig(vocab_size=32000, hidden_size=4096, num_layers=28, num_heads=32, num_kv_heads=32, intermediate_size=11008)
    report = doctor(seed, kv_lora_rank=1024, qk_rope_head_dim=64)
    assert report.attention_kind == "MHA"
    assert report.kv_bytes_per_token_before == SEED_BEFORE
    assert report.kv_bytes_per_token_after == 28 * (1024 + 64) * 2
    latent_only = seed.num_layers * report.kv_lora_rank * report.dtype_bytes
    assert latent_only == SEED_AFTER
    # The seed's numbers are 1K = 1000 tokens, 1 GB = 10^9 bytes (its 8K entry, 3.68, doubles the rounded 1.84).
    rows = kv_cache_table(report.kv_bytes_per_token_before, latent_only, contexts=(1000, 4000, 8000, 32000))
    assert [r["gb_before"] for r in rows] == pytest.approx([0.46, 1.84, 3.68, 14.7], rel=0.003)  # 3 digits
    assert [r["gb_after"] for r in rows] == pytest.approx([0.06, 0.23, 0.46, 1.84], abs=0.005)
    assert all(r["reduction_pct"] == pytest.approx(87.5) and int(r["reduction_pct"]) == 87 for r in rows)
    text = format_kv_cache_table(rows)
    assert "0.46 GB -> 0.06 GB" in text and "1.84 GB -> 0.23 GB" in text and "14.7 GB -> 1.84 GB" in text
    assert "-87.5%" in text


def test_seed_table_default_contexts():
    rows = kv_cache_table(SEED_BEFORE, SEED_AFTER)
    assert [r["context"] for r in rows] == [1024, 4096, 8192, 32768]
    assert [r["label"] for r in rows] == ["1K", "4K", "8K", "32K"]
    assert rows[0]["bytes_before"] == SEED_BEFORE * 1024 and rows[0]["bytes_after"] == SEED_AFTER * 1024
    # 1K = 1024 tokens is 2.4% more than the seed's 1000: the same numbers within that rounding
    assert [r["gb_before"] for r in rows] == pytest.approx([0.46, 1.84, 3.68, 14.7], rel=0.025)
    assert [r["gb_after"] for r in rows] == pytest.approx([0.06, 0.23, 0.46, 1.84], rel=0.025)
    text = format_kv_cache_table(rows)
    assert text.splitlines()[1].split() == ["1K", "0.47", "GB", "->", "0.06", "GB", "-87.5%"]


def test_table_units_and_growth():
    rows = kv_cache_table(256, 384, contexts=(1024, 32768))
    assert rows[0]["reduction_pct"] == pytest.approx(-50.0)
    text = format_kv_cache_table(rows)
    assert "MB" in text and "+50.0%" in text and "GB" not in text
    with pytest.raises(ValueError):
        kv_cache_table(-1, 2)
    with pytest.raises(ValueError):
        kv_cache_table(1, 2, contexts=(0,))


# ---- one config.json per family (no weights) ---------------------------------------------------------


def test_llama_gqa_from_config_json(tmp_path):
    path = _write(
        tmp_path,
        "llama",
        dict(
            HF_COMMON,
            model_type="llama",
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=2,
            tie_word_embeddings=True,
        ),
    )
    report = doctor(path)
    assert report.model_type == "llama" and report.source == str(path)
    assert report.attention_kind == "GQA 4:1"
    assert (report.num_layers, report.hidden_size, report.num_heads, report.num_kv_heads, report.head_dim) == (2, 64, 8, 2, 8)
    assert report.kv_width == 2 * 2 * 8
    # the default rule (convert's): budget 32 / 4 = 8 values, d_rope = min(64, head_dim 8, 8 / 2) = 4, d_c = 4
    assert (report.kv_lora_rank, report.qk_rope_head_dim) == (4, 4)
    assert report.kv_bytes_per_token_before == 2 * (2 * 2 * 8) * 2 == 128
    assert report.kv_bytes_per_token_after == 2 * (4 + 4) * 2 == 32
    assert report.kv_compression == pytest.approx(4.0) and report.kv_saving_pct == pytest.approx(75.0)
    assert report.kv_cache[0]["bytes_before"] == 128 * 1024
    assert report.rope == {"rope_type": "default", "theta": 10000.0}
    assert report.tie_word_embeddings and not report.qkv_bias and not report.qk_norm
    assert report.sliding_window is None and report.sliding_layers == []
    assert report.num_parameters == num_parameters(
        ModelConfig(
            vocab_size=64,
            hidden_size=64,
            num_layers=2,
            num_heads=8,
            num_kv_heads=2,
            intermediate_size=96,
            tie_word_embeddings=True,
        )
    )
    assert report.num_parameters_after is not None
    assert report.blockers == [] and report.warnings == [] and report.notes == []
    assert report.verdict == "convertible"
    assert any("DeepSeek" in line and "64" in line for line in report.info)
    assert any("FlashMLA" in line and "miss" in line for line in report.fast_path)
    text = report.format()
    assert "verdict: convertible" in text and "GQA 4:1" in text and "128 B now -> 32 B after" in text
    json.dumps(report.to_dict())  # JSON-ready


def test_qwen2_biases_from_config_json(tmp_path):
    path = _write(
        tmp_path,
        "qwen2",
        dict(
            HF_COMMON,
            model_type="qwen2",
            hidden_size=32,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=4,
            sliding_window=4096,
            use_sliding_window=False,
            rope_theta=1e6,
        ),
    )
    report = doctor(path, kv_lora_rank=16, qk_rope_head_dim=4)
    assert report.model_type == "qwen2" and report.attention_kind == "MHA"
    assert report.qkv_bias and not report.o_bias
    assert report.rope["theta"] == 1e6
    assert report.sliding_window is None  # use_sliding_window false
    assert report.kv_bytes_per_token_before == 3 * (2 * 4 * 8) * 2 == 384
    assert report.kv_bytes_per_token_after == 3 * (16 + 4) * 2 == 120
    assert report.blockers == []
    assert any("bias" in n and "engines" in n and "vLLM and SGLang load no attention bias" in n for n in report.notes)
    assert report.verdict == "convertible with notes"


def test_engine_table_follows_the_shape(tmp_path):
    """doctor says, per engine and MLA backend, whether a stock export of the chosen ranks runs: vLLM's CPU
    backends take 512 + 64 only, TRITON_MLA any shape, FlashInfer MLA also needs qk_nope_head_dim 64/128/192."""
    path = _write(
        tmp_path,
        "llama",
        dict(
            HF_COMMON,
            model_type="llama",
            hidden_size=1024,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=8,
            head_dim=128,
        ),
    )
    runs = {(e["engine"], e["backend"]): e for e in doctor(path, kv_lora_rank=512, qk_rope_head_dim=64).engines}
    assert runs[("vLLM", "CPU_MLA")]["runs"] and runs[("vLLM", "FLASHINFER_MLA")]["runs"]
    assert "make test-vllm" in runs[("vLLM", "CPU_MLA")]["tested"]
    report = doctor(path, kv_lora_rank=448, qk_rope_head_dim=64)
    runs = {(e["engine"], e["backend"]): e for e in report.engines}
    assert not runs[("vLLM", "CPU_MLA")]["runs"] and "576 only" in runs[("vLLM", "CPU_MLA")]["why"]
    assert runs[("vLLM", "TRITON_MLA")]["runs"] and runs[("transformers", "DeepseekV3ForCausalLM (eager / sdpa)")]["runs"]
    assert "vLLM CPU_MLA" in report.format() and "448 + 64 = 512" in report.format()


def test_qwen3_qk_norm_is_convertible_with_a_note(tmp_path):
    path = _write(
        tmp_path,
        "qwen3",
        dict(
            HF_COMMON,
            model_type="qwen3",
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
        ),
    )
    report = doctor(path)
    assert report.model_type == "qwen3" and report.attention_kind == "GQA 2:1"
    assert report.head_dim == 16 and report.qk_norm
    assert report.kv_bytes_per_token_before == 2 * (2 * 2 * 16) * 2 == 256
    assert (report.kv_lora_rank, report.qk_rope_head_dim) == (8, 8)  # budget 64 / 4 = 16, split evenly
    assert report.kv_bytes_per_token_after == 2 * (8 + 8) * 2 == 64
    assert report.blockers == []
    assert any("Qwen3" in n and "linear fit" in n for n in report.notes)
    assert report.verdict == "convertible with notes" and report.num_parameters_after is not None


def test_mistral_sliding_window_from_config_json(tmp_path):
    path = _write(
        tmp_path,
        "mistral",
        dict(
            HF_COMMON,
            model_type="mistral",
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            sliding_window=64,
        ),
    )
    report = doctor(path)
    assert report.model_type == "mistral" and report.attention_kind == "MQA"
    assert report.sliding_window == 64 and report.sliding_layers == [0, 1]
    assert report.kv_width == 2 * 1 * 16
    assert (report.kv_lora_rank, report.qk_rope_head_dim) == (4, 4)  # MQA: budget 32 / 4 = 8, split evenly
    assert report.kv_bytes_per_token_before == 2 * 32 * 2 and report.kv_bytes_per_token_after == 2 * 8 * 2
    assert report.warnings == [] and report.blockers == []
    assert any("sliding window" in n and "cannot express" in n for n in report.notes)
    assert report.verdict == "convertible with notes"
    assert "64 tokens on layers all (2)" in report.format()


def test_kvgraft_format_already_mla(tmp_path):
    mla = _cfg(attention_kinds=("mla", "gqa"), kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8)
    path = _write(tmp_path, "kvgraft", kvgraft_config_dict(mla))
    report = doctor(path)
    assert report.model_type == "kvgraft"
    assert report.mla_layers == [0] and "MLA on 1/2 layers" in report.attention_kind
    assert report.kv_bytes_per_token_before == (8 + 4) * 2 + 32 * 2
    assert "already_mla" in [b.code for b in report.blockers] and report.verdict == "blocked"


# ---- warnings, fast path, blockers --------------------------------------------------------------------


def test_mqa_bigger_cache_warning():
    mqa = _cfg(hidden_size=128, num_heads=4, num_kv_heads=1)  # head_dim 32, KV width 2 x 1 x 32 = 64
    report = doctor(mqa, kv_lora_rank=64, qk_rope_head_dim=32)
    assert report.attention_kind == "MQA" and report.kv_width == 64
    assert report.blockers == []
    assert len(report.warnings) == 1 and "MORE" in report.warnings[0] and "grow" in report.warnings[0]
    assert report.kv_bytes_per_token_before == 2 * 64 * 2
    assert report.kv_bytes_per_token_after == 2 * (64 + 32) * 2
    assert report.kv_saving_pct == pytest.approx(-50.0)
    assert report.verdict == "convertible with notes"
    text = report.format()
    assert "WARNING:" in text and "LARGER" in text and "+50.0%" in text


def test_flashmla_shapes():
    cfg = _cfg(hidden_size=256, num_heads=4, num_kv_heads=4)  # head_dim 64, KV width 512
    hit = doctor(cfg, kv_lora_rank=512, qk_rope_head_dim=64)
    assert any("match FlashMLA" in n for n in hit.fast_path)
    assert hit.warnings and "grow" in hit.warnings[0]  # 512 + 64 = 576 > 512 values per layer
    miss = doctor(cfg, kv_lora_rank=128, qk_rope_head_dim=32)
    assert any("FlashMLA" in n and "d_c = 512 and d_rope = 64" in n and "miss" in n for n in miss.fast_path)
    assert miss.verdict == "convertible"


def test_rank_blockers_and_rope_notes():
    cfg = _cfg()  # GQA 4:1, head_dim 8, KV width 32, RoPE width 16
    report = doctor(cfg, kv_lora_rank=40, qk_rope_head_dim=18)
    assert {b.code for b in report.blockers} == {"d_c_too_large", "d_rope_too_large"}
    assert report.verdict == "blocked"
    odd = doctor(cfg, kv_lora_rank=8, qk_rope_head_dim=3)
    assert [b.code for b in odd.blockers] == ["invalid_ranks"]
    wide = doctor(cfg, kv_lora_rank=8, qk_rope_head_dim=12)  # <= 16 but does not divide head_dim 8
    assert wide.blockers == [] and any("'stride' RoPE selection" in n for n in wide.notes)
    shared = doctor(_cfg(num_layers=4, kv_slots=(0, 0, 2, 2)))
    assert [b.code for b in shared.blockers] == ["cross_layer_kv"]
    with pytest.raises(ValueError):
        doctor(cfg, kv_lora_rank=0)
    with pytest.raises(ValueError):
        doctor(cfg, dtype_bytes=0)


def test_rope_scaling_reported_and_carried_over():
    llama3 = _cfg(
        rope=RopeConfig(
            rope_type="llama3",
            theta=500000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        )
    )
    report = doctor(llama3)
    assert report.rope == {
        "rope_type": "llama3",
        "theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert any("llama3" in n and "carried over" in n for n in report.notes)
    yarn = doctor(_cfg(rope=RopeConfig(rope_type="yarn", factor=4.0, original_max_position_embeddings=1024)))
    assert yarn.rope["rope_type"] == "yarn" and yarn.rope["factor"] == 4.0
    assert "yarn (theta 10000, factor 4" in yarn.format()


def test_attention_kinds_and_default_rank():
    assert attention_kind(32, 32) == "MHA"
    assert attention_kind(32, 8) == "GQA 4:1"
    assert attention_kind(32, 1) == "MQA"
    # convert's rule: budget = KV width / 4, d_rope = largest even <= min(64, head_dim, budget / 2), d_c the rest
    assert default_kv_lora_rank(_cfg(hidden_size=4096, num_heads=32, num_kv_heads=8)) == 448  # 512 - 64
    assert default_kv_lora_rank(_cfg(hidden_size=96, num_heads=8, num_kv_heads=2)) == 6  # 48 / 4 = 12 = 6 + 6
    assert default_kv_lora_rank(_cfg(hidden_size=160, num_heads=8, num_kv_heads=2)) == 10  # 80 / 4 = 20 = 10 + 10
    with pytest.raises(ValueError, match="leaves 2 cached values per layer"):  # 8 / 4: no room for RoPE + latent
        default_kv_lora_rank(_cfg(hidden_size=16, num_heads=4, num_kv_heads=1))


def test_to_dict_round_trips_json():
    report = doctor(_cfg(qkv_bias=True), kv_lora_rank=8, qk_rope_head_dim=4)
    d = json.loads(json.dumps(report.to_dict()))
    assert d["attention_kind"] == "GQA 4:1" and d["verdict"] == report.verdict
    assert d["kv_cache"][0]["label"] == "1K" and isinstance(d["blockers"], list)
    assert set(d) == {f.name for f in dataclasses.fields(DoctorReport)}


# ---- bad input ----------------------------------------------------------------------------------------


def test_missing_directory_raises_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError):
        doctor(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError):
        doctor(tmp_path / "empty")
    with pytest.raises(CheckpointError):
        doctor("no-such-reference-model")
