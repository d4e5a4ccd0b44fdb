"""`kvgraft convert` on real transformers checkpoints of each family, built in-test from tiny random configs.

At full budget the graft must reproduce transformers' own logits (exact families) or come close
(Qwen3, whose key RMSNorm is linearised); at 4x it must stay finite and loadable, and the stock
DeepSeek-V3 export must load in unmodified transformers where the family allows it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from kvgraft.cli import main
from kvgraft.hf import load_pretrained

TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
    head_dim=16,
)
FAMILIES = {
    "llama": dict(),
    "mistral": dict(sliding_window=12),
    "qwen2": dict(),  # q/k/v biases
    "qwen3": dict(),  # q/k norms
}
IDS = torch.randint(0, 96, (2, 30), generator=torch.Generator().manual_seed(0))


def _hf_checkpoint(tmp_path, family: str, kv_heads: int = 2, **extra):
    cfg = transformers.AutoConfig.for_model(family, **(TINY | {"num_key_value_heads": kv_heads} | FAMILIES[family] | extra))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # non-trivial biases and norm weights (transformers initialises them to 0 / 1)
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.3)
            elif "norm" in name:
                p.uniform_(0.6, 1.4)
            elif "k_proj" in name or "q_proj" in name:
                p.mul_(4)
    path = tmp_path / f"{family}-kv{kv_heads}"
    model.save_pretrained(path)
    (path / "eval").mkdir()
    np.save(path / "eval" / "calibration.npy", np.random.default_rng(0).integers(0, 96, 4096).astype(np.uint16))
    return model, path


@pytest.mark.parametrize("family", list(FAMILIES))
def test_convert_each_family_at_full_budget(tmp_path, family):
    hf, path = _hf_checkpoint(tmp_path, family)
    out = tmp_path / "mla"
    # full budget: the latent holds all of K and V, and every (head, frequency) pair keeps RoPE
    assert (
        main(
            [
                "convert",
                str(path),
                "--out",
                str(out),
                "--kv-lora-rank",
                "64",
                "--rope-dim",
                "32",
                "--rope-selection",
                "norm",
                "--calibration-tokens",
                "2048",
            ]
        )
        == 0
    )
    converted = load_pretrained(out)
    with torch.no_grad():
        want = hf(IDS).logits
        got = converted(IDS)
    err = (got - want).abs().max().item()
    print(f"{family}: full-budget max logit error {err:.2e} (logits up to {want.abs().max().item():.2f})")
    if family == "qwen3":  # the key norm is fitted, not reproduced
        assert err < 0.5 * want.abs().max().item(), err
    else:
        assert err < 1e-4, err


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_convert_each_family_at_4x(tmp_path, family):
    _, path = _hf_checkpoint(tmp_path, family)
    out = tmp_path / "mla"
    assert (
        main(["convert", str(path), "--out", str(out), "--compression", "4", "--rope-dim", "8", "--calibration-tokens", "2048"])
        == 0
    )
    converted = load_pretrained(out)
    assert converted.config.kv_bytes_per_token(2) * 4 == load_pretrained(path).config.kv_bytes_per_token(2)
    with torch.no_grad():
        assert torch.isfinite(converted(IDS)).all()


def test_convert_llama_to_stock_deepseek_v3(tmp_path):
    _, path = _hf_checkpoint(tmp_path, "llama")
    out = tmp_path / "mla"
    with pytest.warns(UserWarning, match="only transformers computes"):
        assert (
            main(
                [
                    "convert",
                    str(path),
                    "--out",
                    str(out),
                    "--compression",
                    "2",
                    "--rope-dim",
                    "16",
                    "--calibration-tokens",
                    "2048",
                    "--format",
                    "both",
                    "--stock-construction",
                    "transformers",
                ]
            )
            == 0
        )
    ours = load_pretrained(out)
    stock, info = transformers.AutoModelForCausalLM.from_pretrained(out / "deepseek_v3", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert type(stock).__name__ == "DeepseekV3ForCausalLM"
    with torch.no_grad():
        a, b = ours(IDS), stock.eval()(IDS).logits
    # the latent RMSNorm that stock DeepSeek-V3 always applies is pinned exactly ("pad" latent, transformers only)
    assert (a - b).abs().max().item() < 1e-4


# ---- the default conversion (no flags) on every family and GQA ratio -------------------------------------

DEFAULT_CASES = [(family, 2) for family in FAMILIES] + [("llama", 1), ("qwen2", 1), ("qwen3", 1), ("mistral", 4)]


@pytest.mark.parametrize("family,kv_heads", DEFAULT_CASES, ids=[f"{f}-kv{k}" for f, k in DEFAULT_CASES])
def test_default_convert_succeeds_on_every_family_and_gqa_ratio(tmp_path, family, kv_heads):
    """`kvgraft convert DIR --out OUT` with no flags: 4x, ranks from the one rule, the same ranks doctor shows."""
    from kvgraft.graft.doctor import doctor
    from kvgraft.graft.ranks import default_ranks

    _, path = _hf_checkpoint(tmp_path, family, kv_heads)
    out = tmp_path / "mla"
    assert main(["convert", str(path), "--out", str(out)]) == 0
    converted = load_pretrained(out)
    original = load_pretrained(path).config
    ranks = default_ranks(original)
    assert (converted.config.kv_lora_rank, converted.config.qk_rope_head_dim) == (ranks.kv_lora_rank, ranks.qk_rope_head_dim)
    report = doctor(path)
    assert (report.kv_lora_rank, report.qk_rope_head_dim) == (ranks.kv_lora_rank, ranks.qk_rope_head_dim)
    assert report.blockers == []
    assert converted.config.kv_bytes_per_token(2) * 4 == original.kv_bytes_per_token(2)  # the default 4x
    with torch.no_grad():
        assert torch.isfinite(converted(IDS)).all()


def test_default_stock_export_of_an_mqa_llama(tmp_path):
    """MQA (one KV head, budget 32 / 4 = 8 values) with --format both and no rank flags: the rule picks a
    stock-exportable d_rope and the export loads in unmodified transformers."""
    _, path = _hf_checkpoint(tmp_path, "llama", kv_heads=1)
    out = tmp_path / "mla"
    assert main(["convert", str(path), "--out", str(out), "--format", "both"]) == 0
    ours = load_pretrained(out)
    # the rule's 4 + 4, kept whole by the engine-safe export (its latent norm is fitted, not pinned)
    assert (ours.config.kv_lora_rank, ours.config.qk_rope_head_dim) == (4, 4)
    import json

    record = json.loads((out / "conversion.json").read_text())
    assert record["deepseek_v3"]["path"] == str(out / "deepseek_v3")  # the final place, not the temporary one
    assert record["deepseek_v3"]["kv_lora_rank"] == 4 and record["deepseek_v3"]["compression"] == 4.0
    assert json.loads((out / "deepseek_v3" / "config.json").read_text())["kv_lora_rank"] == 4
    assert record["ranks_chosen"] and record["graft"]["rope_selection"] == "prefix"
    assert record["graft"]["rope_rotation"] == "complex"
    stock = transformers.AutoModelForCausalLM.from_pretrained(out / "deepseek_v3")
    with torch.no_grad():
        assert torch.isfinite(stock.eval()(IDS).logits).all()


# ---- the share graft on Qwen3 (q/k norms) ---------------------------------------------------------------


def test_share_graft_on_qwen3_by_default(tmp_path):
    """`convert --to ced` on Qwen3: both per-head norms become their least-squares linear fits, no flags."""
    import json

    _, path = _hf_checkpoint(tmp_path, "qwen3")
    out = tmp_path / "ced"
    assert main(["convert", str(path), "--out", str(out), "--to", "ced"]) == 0
    record = json.loads((out / "conversion.json").read_text())
    assert record["graft"]["qk_norm"] == "linearise"
    converted = load_pretrained(out)
    assert converted.config.is_ced and not converted.config.qk_norm
    with torch.no_grad():
        assert torch.isfinite(converted(IDS)).all()


def test_share_graft_on_qwen3_at_full_budget_tracks_the_original(tmp_path):
    """Every layer a kv_source layer, m = 1, full ranks, a window covering the context: only the two
    fitted norms separate the result from transformers' Qwen3."""
    hf, path = _hf_checkpoint(tmp_path, "qwen3")
    out = tmp_path / "ced"
    assert (
        main(
            [
                "convert",
                str(path),
                "--out",
                str(out),
                "--to",
                "ced",
                "--kv-source-layers",
                "0",
                "1",
                "--kv-lora-rank",
                "64",
                "--rope-dim",
                "32",
                "--sliding-window",
                "64",
                "--calibration-tokens",
                "2048",
            ]
        )
        == 0
    )
    with torch.no_grad():
        want = hf(IDS).logits
        got = load_pretrained(out)(IDS)
    err = (got - want).abs().max().item()
    print(f"qwen3 share graft at full budget: max logit error {err:.2e} (logits up to {want.abs().max().item():.2f})")
    assert err < 0.5 * want.abs().max().item(), err


# ---- stock DeepSeek-V3 exports of every family ---------------------------------------------------------

STOCK_CASES = {
    "llama": ("llama", {}),
    "llama-attention-bias": ("llama", {"attention_bias": True}),  # q/k/v/o biases
    "qwen2": ("qwen2", {}),  # q/k/v biases
    "mistral": ("mistral", {}),  # sliding window 12
    "qwen3": ("qwen3", {}),  # q/k norms: linearised by the graft
    "llama-yarn": ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}}),
}


@pytest.mark.parametrize("case", list(STOCK_CASES))
def test_stock_export_of_each_family(tmp_path, case, capsys):
    """`convert --format both --stock-construction transformers` (default 4x): the export loads in stock
    transformers and reproduces the converted model exactly (Mistral: up to its window); conversion.json and
    the printed report carry the measured error and the calibration-tail perplexities."""
    import json

    family, extra = STOCK_CASES[case]
    _, path = _hf_checkpoint(tmp_path, family, **extra)
    out = tmp_path / "mla"
    with pytest.warns(UserWarning, match="only transformers computes"):
        assert (
            main(
                [
                    "convert",
                    str(path),
                    "--out",
                    str(out),
                    "--format",
                    "both",
                    "--calibration-tokens",
                    "512",
                    "--stock-construction",
                    "transformers",
                ]
            )
            == 0
        )
    printed = capsys.readouterr().out
    assert "stock DeepSeek-V3 export" in printed and "calibration tail" in printed
    record = json.loads((out / "conversion.json").read_text())
    ds = record["deepseek_v3"]
    assert ds["path"] == str(out / "deepseek_v3") and ds["measured_on"].startswith("the calibration tail")
    assert ds["perplexity"]["deepseek_v3"] > 0 and record["calibration_tail"]["original_perplexity"] > 0
    assert ds["compression"] == 4.0  # the constant latent coordinate is inside the 4x budget
    ours = load_pretrained(out)
    stock, info = transformers.AutoModelForCausalLM.from_pretrained(out / "deepseek_v3", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    stock.eval()
    with torch.no_grad():
        if case == "mistral":
            assert not ds["exact"] and ds["exact_up_to_tokens"] == 12 and ds["max_abs_logit_diff_within_window"] < 1e-4
            assert "Exact for contexts up to 12 tokens" in (out / "deepseek_v3" / "README.md").read_text()
            ids = IDS[:, :12]
        else:
            assert ds["exact"] and ds["max_abs_logit_diff"] < 1e-4, ds
            ids = IDS
        err = (ours(ids) - stock(ids).logits).abs().max().item()
    assert err < 1e-4, err
    if case in ("qwen2", "llama-attention-bias"):
        assert ds["q_lora_rank"] == 65  # the query bias through the low-rank query path
    if case == "qwen3":
        assert record["qk_norm_linearised_for_stock_export"] and "linear fits" in printed


def test_full_budget_stock_export_with_several_kv_heads(tmp_path, capsys):
    """Full budget (d_c = the KV width) with 2 KV heads: stock's one shared RoPE key rotates each frequency once,
    so the exact kvgraft-format layout (d_rope = 2 x head_dim) is refused naming --rope-dim, and the default
    (d_rope = head_dim) exports exactly what was grafted, its distance from the original measured."""
    import json

    hf, path = _hf_checkpoint(tmp_path, "llama")
    rc = main(
        [
            "convert",
            str(path),
            "--out",
            str(tmp_path / "refused"),
            "--format",
            "deepseek_v3",
            "--kv-lora-rank",
            "64",
            "--rope-dim",
            "32",
            "--calibration-tokens",
            "512",
        ]
    )
    err = capsys.readouterr().err
    assert rc != 0 and "--rope-dim with an even value <= 16" in err and "2 KV heads" in err
    assert not (tmp_path / "refused").exists()
    out = tmp_path / "mla"
    with pytest.warns(UserWarning, match="only transformers computes"):
        assert (
            main(
                [
                    "convert",
                    str(path),
                    "--out",
                    str(out),
                    "--format",
                    "both",
                    "--kv-lora-rank",
                    "64",
                    "--calibration-tokens",
                    "512",
                    "--stock-construction",
                    "transformers",
                    "--no-latent-norm",  # the pad construction: one constant latent coordinate more
                ]
            )
            == 0
        )
    record = json.loads((out / "conversion.json").read_text())
    assert record["deepseek_v3"]["kv_lora_rank"] == 65 and record["deepseek_v3"]["exact"]
    stock = transformers.AutoModelForCausalLM.from_pretrained(out / "deepseek_v3").eval()
    with torch.no_grad():
        assert (load_pretrained(out)(IDS) - stock(IDS).logits).abs().max().item() < 1e-4
        vs_original = (hf(IDS).logits - stock(IDS).logits).abs().max().item()
    print(f"full budget, 2 KV heads, d_rope 16: stock export vs the original max |dlogit| {vs_original:.3g}")
    assert vs_original > 1e-4  # the shared RoPE key cannot carry both heads' rotations: not exact


def test_refused_stock_export_names_the_flag_that_makes_it_possible(tmp_path, capsys):
    """Dynamic NTK RoPE needs d_rope = head_dim in stock DeepSeek-V3: at 4x (16 values) there is no room for a
    latent, so the refusal (before any work) names the compression that fits."""
    _, path = _hf_checkpoint(tmp_path, "llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    out = tmp_path / "mla"
    assert main(["convert", str(path), "--out", str(out), "--format", "deepseek_v3"]) == 2
    err = capsys.readouterr().err
    assert "needs d_rope in [16]" in err and "--compression 3.764 or lower" in err and "--format kvgraft" in err
    assert not out.exists()
    assert (
        main(
            [
                "convert",
                str(path),
                "--out",
                str(out),
                "--format",
                "deepseek_v3",
                "--compression",
                "3.764",
                "--calibration-tokens",
                "512",
            ]
        )
        == 0
    )
    assert (out / "deepseek_v3" / "config.json").is_file()


@pytest.mark.parametrize("case", list(STOCK_CASES))
def test_engine_safe_stock_export_of_each_family(tmp_path, case):
    """The default stock export (`--stock-construction engines`): nothing vLLM or SGLang would drop or overflow
    (no attention bias tensor, `attention_bias: false`, every weight within fp16's range), the graft's whole
    latent budget kept, no missing or unexpected keys in transformers, and the approximation stated and
    measured (the latent norm fitted; biases folded into the weights)."""
    import json

    from safetensors.torch import load_file

    family, extra = STOCK_CASES[case]
    _, path = _hf_checkpoint(tmp_path, family, **extra)
    out = tmp_path / "mla"
    # --no-latent-norm: the export approximates the latent norm ('fit'); the default grafts it (exact, tests/test_refine.py)
    assert (
        main(["convert", str(path), "--out", str(out), "--format", "both", "--calibration-tokens", "512", "--no-latent-norm"])
        == 0
    )
    record = json.loads((out / "conversion.json").read_text())
    ds = record["deepseek_v3"]
    assert record["stock_construction"] == "engines" and ds["target"] == "engines"
    config = json.loads((out / "deepseek_v3" / "config.json").read_text())
    assert config["attention_bias"] is False and config["q_lora_rank"] is None
    tensors = load_file(str(out / "deepseek_v3" / "model.safetensors"))
    assert not [k for k in tensors if k.endswith(".bias")]
    assert max(float(t.abs().max()) for t in tensors.values()) <= 65504
    ours = load_pretrained(out)
    assert ds["kv_lora_rank"] == ours.config.kv_lora_rank and ds["compression"] == 4.0
    stock, info = transformers.AutoModelForCausalLM.from_pretrained(out / "deepseek_v3", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert not ds["exact"] and any("latent RMSNorm approximated ('fit')" in a for a in ds["approximations"])
    if case in ("qwen2", "llama-attention-bias"):
        assert any("attention biases" in a for a in ds["approximations"])
    # the measured cost on the calibration tail of these random models: small, not zero
    assert 0 < ds["mean_kl"] < 0.05, ds


def test_target_vllm_picks_512_plus_64_or_says_why_not(tmp_path, capsys):
    """`convert --target vllm`: the stock export at d_c 512 + d_rope 64 (the only shape vLLM's CPU backends and
    FlashMLA-class kernels take) where the KV width allows; refused before any work, saying why, where not."""

    _, small = _hf_checkpoint(tmp_path, "llama")  # KV width 2 x 2 x 16 = 64 values per layer
    assert main(["convert", str(small), "--out", str(tmp_path / "no"), "--target", "vllm"]) == 2
    err = capsys.readouterr().err
    assert "512 + 64" in err and "holds 64 values" in err and "head_dim is 16" in err and "TRITON_MLA" in err
    assert not (tmp_path / "no").exists()
    assert main(["convert", str(small), "--out", str(tmp_path / "no"), "--target", "vllm", "--format", "kvgraft"]) == 2
    assert "writes none" in capsys.readouterr().err


@pytest.mark.slow  # ~25 s on 2 cores (fitting 512-wide latent norms); make test-vllm serves the same shape
def test_target_vllm_takes_512_plus_64(tmp_path):
    import json

    # 8 KV heads x 64 = 1,024 values per layer: takes 512 + 64
    _, wide = _hf_checkpoint(
        tmp_path, "llama", kv_heads=8, hidden_size=512, num_attention_heads=8, head_dim=64, intermediate_size=128
    )
    out = tmp_path / "vllm"
    assert (
        main(
            [
                "convert",
                str(wide),
                "--out",
                str(out),
                "--target",
                "vllm",
                "--calibration-tokens",
                "64",
                "--objective",
                "activations",
                "--no-layerwise",
                "--no-rope-expectation",
            ]
        )
        == 0
    )
    record = json.loads((out / "conversion.json").read_text())
    assert record["serve_target"] == "vllm" and record["formats"] == ["deepseek_v3"]
    config = json.loads((out / "deepseek_v3" / "config.json").read_text())
    assert (config["kv_lora_rank"], config["qk_rope_head_dim"], config["attention_bias"]) == (512, 64, False)
    cpu = [e for e in record["deepseek_v3"]["engines"] if e["backend"] == "CPU_MLA"]
    assert cpu and cpu[0]["runs"]
