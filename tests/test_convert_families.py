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

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, head_dim=16)
FAMILIES = {
    "llama": dict(),
    "mistral": dict(sliding_window=12),
    "qwen2": dict(),  # q/k/v biases
    "qwen3": dict(),  # q/k norms
}
IDS = torch.randint(0, 96, (2, 30), generator=torch.Generator().manual_seed(0))


def _hf_checkpoint(tmp_path, family: str, kv_heads: int = 2):
    cfg = transformers.AutoConfig.for_model(family, **(TINY | {"num_key_value_heads": kv_heads}), **FAMILIES[family])
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
    np.save(path / "eval" / "calibration.npy",
            np.random.default_rng(0).integers(0, 96, 4096).astype(np.uint16))
    return model, path


@pytest.mark.parametrize("family", list(FAMILIES))
def test_convert_each_family_at_full_budget(tmp_path, family):
    hf, path = _hf_checkpoint(tmp_path, family)
    out = tmp_path / "mla"
    # full budget: the latent holds all of K and V, and every (head, frequency) pair keeps RoPE
    assert main(["convert", str(path), "--out", str(out), "--kv-lora-rank", "64", "--rope-dim", "32",
                 "--rope-selection", "norm", "--calibration-tokens", "2048"]) == 0
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
    assert main(["convert", str(path), "--out", str(out), "--compression", "4", "--rope-dim", "8",
                 "--calibration-tokens", "2048"]) == 0
    converted = load_pretrained(out)
    assert converted.config.kv_bytes_per_token(2) * 4 == load_pretrained(path).config.kv_bytes_per_token(2)
    with torch.no_grad():
        assert torch.isfinite(converted(IDS)).all()


def test_convert_llama_to_stock_deepseek_v3(tmp_path):
    _, path = _hf_checkpoint(tmp_path, "llama")
    out = tmp_path / "mla"
    assert main(["convert", str(path), "--out", str(out), "--compression", "2", "--rope-dim", "16",
                 "--calibration-tokens", "2048", "--format", "both"]) == 0
    ours = load_pretrained(out)
    stock, info = transformers.AutoModelForCausalLM.from_pretrained(out / "deepseek_v3", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert type(stock).__name__ == "DeepseekV3ForCausalLM"
    with torch.no_grad():
        a, b = ours(IDS), stock.eval()(IDS).logits
    # only the latent RMSNorm (always applied by stock DeepSeek-V3) separates the two
    assert (a - b).abs().max().item() < 0.1 * a.abs().max().item()


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
    assert (converted.config.kv_lora_rank, converted.config.qk_rope_head_dim) == (ranks.kv_lora_rank,
                                                                                   ranks.qk_rope_head_dim)
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
    assert (ours.config.kv_lora_rank, ours.config.qk_rope_head_dim) == (4, 4)
    import json

    record = json.loads((out / "conversion.json").read_text())
    assert record["deepseek_v3"]["path"] == str(out / "deepseek_v3")  # the final place, not the temporary one
    assert record["ranks_chosen"] and record["graft"]["rope_selection"] == "stride"
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
    assert main(["convert", str(path), "--out", str(out), "--to", "ced", "--kv-source-layers", "0", "1",
                 "--kv-lora-rank", "64", "--rope-dim", "32", "--sliding-window", "64",
                 "--calibration-tokens", "2048"]) == 0
    with torch.no_grad():
        want = hf(IDS).logits
        got = load_pretrained(out)(IDS)
    err = (got - want).abs().max().item()
    print(f"qwen3 share graft at full budget: max logit error {err:.2e} (logits up to {want.abs().max().item():.2f})")
    assert err < 0.5 * want.abs().max().item(), err
