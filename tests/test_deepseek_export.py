"""Export of all-MLA kvgraft models as stock DeepSeek-V3 checkpoints (kvgraft.hf.deepseek).

Tiny random Llama-like models are grafted to MLA (stride RoPE selection), exported, and loaded with stock
transformers: a model with its own latent norm must match exactly (prefill, decode, RoPE scalings, biases), and
so must one without (the default "pad" latent), with q/k/v biases (Qwen2: the query bias through stock's
low-rank query path) and with yarn at d_rope < head_dim; a sliding window is exact up to its length; the "fit"
and "scale" approximations come out close, "fit" closer; what stock DeepSeek-V3 cannot express is refused,
naming what would make it possible.
Run with ``-s`` to see the measured export errors.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from kvgraft.errors import UnsupportedModelError
from kvgraft.graft.mla import GraftConfig, graft_mla
from kvgraft.hf.deepseek import (
    ExportOptions,
    deepseek_v3_fast_path,
    export_deepseek_v3,
    load_stock,
    measure_export_error,
)
from kvgraft.model import ModelConfig, RopeConfig, Transformer
from kvgraft.runtime import generate

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MLP  # noqa: E402

CAL = torch.randint(0, 96, (8, 32), generator=torch.Generator().manual_seed(1))
CAL_FIT = torch.randint(0, 96, (32, 32), generator=torch.Generator().manual_seed(5))  # 1024 tokens for "fit"
HELD_OUT = torch.randint(0, 96, (16, 32), generator=torch.Generator().manual_seed(7))
IDS = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(2))


def _base(
    num_kv_heads: int = 2,
    head_dim: int = 16,
    rope: RopeConfig | None = None,
    bias: bool = False,
    q_bias: bool = False,
    window: int | None = None,
    eps: float = 1e-6,
    tie: bool = False,
    seed: int = 0,
) -> Transformer:
    cfg = ModelConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=64,
        rope=rope or RopeConfig(),
        qkv_bias=bias,
        o_bias=bias,
        sliding_window=window,
        rms_norm_eps=eps,
        tie_word_embeddings=tie,
    )
    model = Transformer(cfg).eval()
    model.init_weights(seed)
    gen = torch.Generator().manual_seed(seed + 100)  # seeded: the figures must not change from run to run
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            elif name.endswith("bias") and (q_bias or "q_proj" not in name):
                # k/v/o biases non-zero (q bias zero unless asked: stock cannot hold it)
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    return model


def _graft(model: Transformer, kv_lora_rank: int, selection: str = "stride", layers=None) -> Transformer:
    g = GraftConfig(
        kv_lora_rank=kv_lora_rank, qk_rope_head_dim=16, objective="activations", rope_selection=selection, layers=layers
    )
    return graft_mla(model, g, CAL, progress=False).eval()


def _with_latent_norm(model: Transformer, seed: int = 3) -> Transformer:
    """The same MLA model with a latent RMSNorm (random weight), DeepSeek's kv_a_layernorm."""
    new = Transformer(model.config.replace(mla_latent_norm=True)).eval()
    missing, unexpected = new.load_state_dict(model.state_dict(), strict=False)
    assert not unexpected and all("kv_a_norm" in k for k in missing)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for block in new.layers:
            w = block.self_attn.kv_a_norm.weight
            w.copy_(torch.rand(w.shape, generator=gen) + 0.5)
    return new


@pytest.fixture(scope="module")
def norm_model() -> Transformer:
    return _with_latent_norm(_graft(_base(2), kv_lora_rank=24))


def test_exact_export_of_a_latent_norm_model(norm_model, tmp_path):
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer_config.json").write_text("{}", encoding="utf-8")
    out = tmp_path / "ds"
    report = export_deepseek_v3(norm_model, out, tokenizer_dir=tok, calibration=CAL)
    assert report.latent_norm == "exact" and report.path == out
    assert report.max_abs_logit_diff <= 1e-4 and report.mean_kl <= 1e-8
    assert {p.name for p in out.iterdir()} == {
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer_config.json",
        "README.md",
    }
    assert "**Exact**" in (out / "README.md").read_text() and report.exact and not report.approximations

    stock, info = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32, output_loading_info=True)
    stock.eval()
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    cfg = stock.config
    raw = json.loads((out / "config.json").read_text())
    assert raw["model_type"] == "deepseek_v3" and "auto_map" not in raw
    assert type(stock).__name__ == "DeepseekV3ForCausalLM" and type(stock).__module__.startswith("transformers.")
    assert cfg.first_k_dense_replace >= cfg.num_hidden_layers == 2
    assert all(type(layer.mlp) is DeepseekV3MLP for layer in stock.model.layers)
    assert cfg.rope_interleave is True and cfg.q_lora_rank is None
    assert (cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim) == (24, 16, 16, 16)
    assert cfg.num_attention_heads == cfg.num_key_value_heads == 4
    assert cfg.num_nextn_predict_layers == 0

    with torch.no_grad():
        ours = norm_model(IDS)
        torch.testing.assert_close(stock(IDS).logits, ours, atol=1e-4, rtol=0)
        # incremental decode with stock transformers' latent cache vs kvgraft's
        prompt = IDS[:, :12]
        gen = stock.generate(
            prompt,
            max_new_tokens=6,
            do_sample=False,
            use_cache=True,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
        mine = generate(norm_model, prompt, max_new_tokens=6)
        assert torch.equal(gen.sequences, mine)
        full = norm_model(mine)
        for step, logits in enumerate(gen.logits):
            torch.testing.assert_close(logits, full[:, 11 + step], atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "case", ["llama3_stride2", "yarn_mscale", "yarn_stride2_truncate", "yarn_stride2_exact_range", "eps_1e-3", "biases", "tied"]
)
def test_exact_export_parity_variants(case, tmp_path):
    """RoPE scalings (with a stride > 1 frequency selection), yarn's softmax mscale, yarn at d_rope < head_dim
    (its correction range re-expressed for dim = d_rope), a non-default norm eps and k/v/o biases (kv_b's bias
    folded into o_proj's) all export exactly for a latent-norm model."""
    if case.startswith("yarn_stride2"):  # d_rope 16 of head_dim 32; truncate stays on when the range allows
        original = 16 if case == "yarn_stride2_truncate" else 32
        base = _base(2, head_dim=32, rope=RopeConfig(rope_type="yarn", factor=4.0, original_max_position_embeddings=original))
    elif case == "llama3_stride2":
        rope = RopeConfig(
            rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16
        )
        base = _base(2, head_dim=32, rope=rope)  # d_rope 16 of head_dim 32: every other frequency
    elif case == "yarn_mscale":
        rope = RopeConfig(rope_type="yarn", factor=4.0, original_max_position_embeddings=16, mscale=0.707, mscale_all_dim=1.0)
        base = _base(2, rope=rope)
    elif case == "eps_1e-3":  # stock's kv_a_layernorm has eps 1e-6: the latent is rescaled to match
        base = _base(2, eps=1e-3)
    elif case == "tied":  # written untied (lm_head = a copy of the embedding), as vLLM's DeepSeek expects
        base = _base(2, tie=True)
    else:
        base = _base(2, bias=True)
    model = _with_latent_norm(_graft(base, kv_lora_rank=24))
    if case == "llama3_stride2":  # exact in transformers; vLLM/SGLang's DeepSeek code would read it as yarn
        with pytest.warns(UserWarning, match="deepseek_yarn"):
            report = export_deepseek_v3(model, tmp_path / "ds", calibration=CAL)
    else:  # biases: exact through attention bias tensors, i.e. for transformers only
        report = export_deepseek_v3(
            model, tmp_path / "ds", ExportOptions(target="transformers" if case == "biases" else "engines"), calibration=CAL
        )
    assert report.latent_norm == "exact"
    assert report.max_abs_logit_diff <= 1e-4, report
    raw = json.loads((tmp_path / "ds" / "config.json").read_text())
    if case == "biases":
        assert raw["attention_bias"] is True
    if case in ("llama3_stride2", "yarn_mscale"):
        assert raw["rope_parameters"]["rope_type"] == raw["rope_scaling"]["type"] == base.config.rope.rope_type
    if case == "yarn_mscale":  # stock's softmax mscale^2 is folded into q_proj
        assert raw["rope_parameters"]["mscale_all_dim"] == 1.0
    if case.startswith("yarn_stride2"):
        assert raw["rope_parameters"].get("truncate", True) is (case == "yarn_stride2_truncate")
        assert raw["rope_parameters"]["beta_fast"] != 32  # re-expressed for dim = d_rope
        with torch.no_grad():  # also at positions past the original context, where yarn's ramp matters
            stock = load_stock(tmp_path / "ds")
            ids = torch.randint(0, 96, (2, 64), generator=torch.Generator().manual_seed(4))
            torch.testing.assert_close(stock(ids).logits, model(ids), atol=1e-4, rtol=0)
    assert raw["tie_word_embeddings"] is False


def test_fit_beats_scale_and_the_reported_errors(tmp_path):
    """Without a latent norm the export approximates it; "fit" must beat "scale". The printed figures (max |logit
    diff|, mean KL in nats, on calibration and held-out text) are the ones the project reports."""
    base = _base(4)
    width = 2 * 4 * 16  # the original per-layer KV cache width
    results = {}
    for budget, rank in (("full budget", width), ("4x compression", width // 4 - 16)):
        model = _graft(base, kv_lora_rank=rank)
        with torch.no_grad():
            graft_err = float((model(HELD_OUT) - base(HELD_OUT)).abs().max())
        for strategy in ("scale", "fit"):
            out = tmp_path / f"{rank}-{strategy}"
            report = export_deepseek_v3(model, out, ExportOptions(latent_norm=strategy), calibration=CAL_FIT)
            assert report.latent_norm == strategy and report.measured_on.startswith("the calibration tail")
            held = measure_export_error(model, out, HELD_OUT)
            results[budget, strategy] = (report.max_abs_logit_diff, report.mean_kl, *held)
            assert all(math.isfinite(x) for x in results[budget, strategy])
            print(
                f"\n[deepseek export] {budget} (d_c={rank}, d_rope=16; graft error vs original {graft_err:.3g}) "
                f"{strategy}: calibration max|dlogit|={report.max_abs_logit_diff:.3g} KL={report.mean_kl:.3g}; "
                f"held-out max|dlogit|={held[0]:.3g} KL={held[1]:.3g}; latent rms cv={report.latent_rms_cv}"
            )
        fit, scale = results[budget, "fit"], results[budget, "scale"]
        assert fit[1] < scale[1] and fit[0] < scale[0]  # on calibration text
        assert fit[3] < scale[3]  # and on held-out text


def test_fit_without_calibration_falls_back_to_scale(tmp_path):
    model = _graft(_base(2), kv_lora_rank=24)
    with pytest.warns(UserWarning, match="falling back to 'scale'"):
        report = export_deepseek_v3(model, tmp_path / "ds", ExportOptions(latent_norm="fit"))
    assert not report.exact and any("latent RMSNorm approximated" in a for a in report.approximations)
    assert report.latent_norm == "scale" and report.measured_on.startswith("random")
    assert math.isfinite(report.max_abs_logit_diff) and math.isfinite(report.mean_kl)
    assert report.max_abs_logit_diff < 1.0
    load_stock(tmp_path / "ds")  # loads cleanly


def _mla_config(**changes) -> ModelConfig:
    """An all-MLA config built directly (stride RoPE layout derived from head_dim and d_rope)."""
    fields = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        attention_kinds=("mla", "mla"),
        kv_lora_rank=24,
        qk_rope_head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=16,
    )
    return ModelConfig(**(fields | changes))


@pytest.mark.parametrize(
    "case,match",
    [
        ("progressive", r"layers \[1\] use GQA.*drop --layers"),
        ("norm_rope_selection", "--rope-selection stride"),
        ("qk_norm", "qk_norm='linearise'"),
        ("kv_sharing", "kv_slots.*--to mla"),
        ("yarn_stride8", "yarn.*--rope-dim 32"),
        ("dynamic_stride2", "dynamic.*--rope-dim 32"),
        ("yarn_prefix_ramp_past_the_key", r"prefix layout.*past pair 7.*--rope-selection stride"),
        ("dynamic_prefix", "dynamic.*whatever the rope selection.*--rope-dim 32"),
        ("mixed_layouts", "not the same in every layer.*--rope-selection stride or prefix"),
        ("mlp_bias", "MLP of layers .* non-zero biases"),
    ],
)
def test_refusals_name_the_problem(case, match, tmp_path):
    if case == "progressive":
        model = _graft(_base(2), 24, layers=(0,))
    elif case == "norm_rope_selection":
        model = _graft(_base(2), 24, selection="norm")
    elif case == "qk_norm":
        model = Transformer(_mla_config(qk_norm=True))
    elif case == "kv_sharing":
        model = Transformer(_mla_config(kv_slots=(0, 0)))
    elif case == "yarn_stride8":  # the ramp ends past stock's last pair: no beta_fast/beta_slow can match it
        model = Transformer(
            _mla_config(
                head_dim=32,
                qk_rope_head_dim=4,
                qk_nope_head_dim=32,
                v_head_dim=32,
                max_position_embeddings=64,
                rope=RopeConfig(rope_type="yarn", theta=10.0, factor=4.0, original_max_position_embeddings=400),
            )
        )
    elif case == "yarn_prefix_ramp_past_the_key":  # ramp over frequencies 1..8: stock clamps its end at pair 7
        model = Transformer(
            _mla_config(
                head_dim=32,
                qk_rope_head_dim=8,
                qk_nope_head_dim=32,
                v_head_dim=32,
                rope_freq_index=((0, 1, 2, 3),) * 2,
                rope=RopeConfig(rope_type="yarn", factor=4.0, original_max_position_embeddings=400),
            )
        )
    elif case == "dynamic_prefix":
        model = Transformer(
            _mla_config(
                head_dim=32,
                qk_rope_head_dim=8,
                qk_nope_head_dim=32,
                v_head_dim=32,
                rope_freq_index=((0, 1, 2, 3),) * 2,
                rope=RopeConfig(rope_type="dynamic", factor=2.0),
            )
        )
    elif case == "mixed_layouts":  # layer 0 prefix, layer 1 stride: stock has one layout for all layers
        model = Transformer(_mla_config(head_dim=32, rope_freq_index=(tuple(range(8)), tuple(range(0, 16, 2)))))
    elif case == "mlp_bias":
        model = Transformer(_mla_config(mlp_bias=True))
        model.init_weights(0)
        with torch.no_grad():
            model.layers[1].mlp.up_proj.bias.fill_(0.1)
    else:
        model = Transformer(_mla_config(head_dim=32, rope=RopeConfig(rope_type="dynamic", factor=2.0)))
    with pytest.raises(UnsupportedModelError, match=match):
        export_deepseek_v3(model, tmp_path / "ds", calibration=CAL)
    assert not (tmp_path / "ds").exists()


@pytest.mark.parametrize("rope", ["default", "llama3", "yarn"])
def test_prefix_layout_exports_exactly(rope, tmp_path):
    """The 'prefix' RoPE selection (the principal rotated head at the d_rope/2 fastest frequencies, any even
    d_rope: 12 here, which does not divide head_dim 32) exports exactly: stock's pair j rotates at
    theta'^(-2j/d_rope), kvgraft's frequency j at theta^(-2j/head_dim), equal for rope_theta' =
    rope_theta^(d_rope/head_dim); llama3 keeps its parameters (its thresholds see the same wavelengths) and so
    does yarn (its correction dims, dim / ln theta, are unchanged). Checked past the original context, and in
    stock transformers' cached decode."""
    ropes = {
        "default": RopeConfig(),
        "llama3": RopeConfig(
            rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16
        ),
        "yarn": RopeConfig(rope_type="yarn", factor=4.0, original_max_position_embeddings=16),
    }
    base = _base(2, head_dim=32, rope=ropes[rope])
    g = GraftConfig(
        kv_lora_rank=24,
        qk_rope_head_dim=12,
        objective="activations",
        rope_selection="prefix",
        rope_rotation="complex" if rope == "yarn" else "real",
    )
    model = graft_mla(base, g, CAL, progress=False).eval()
    assert model.config.rope_freq_index == ((0, 1, 2, 3, 4, 5),) * 2
    if rope == "llama3":  # exact in transformers; vLLM/SGLang's DeepSeek code would read it as yarn
        with pytest.warns(UserWarning, match="deepseek_yarn"):
            report = export_deepseek_v3(model, tmp_path / "ds", ExportOptions(target="transformers"), calibration=CAL)
    else:
        report = export_deepseek_v3(model, tmp_path / "ds", ExportOptions(target="transformers"), calibration=CAL)
    assert report.exact and report.latent_norm == "pad"
    assert report.max_abs_logit_diff <= 1e-4 and report.mean_kl <= 1e-9, report
    assert any("prefix RoPE layout" in w for w in report.warnings)
    raw = json.loads((tmp_path / "ds" / "config.json").read_text())
    params = raw["rope_parameters"]
    assert params["rope_type"] == ropes[rope].rope_type and raw["qk_rope_head_dim"] == 12
    assert params["rope_theta"] == pytest.approx(10000.0 ** (12 / 32), rel=1e-12) == raw["rope_theta"]
    if rope == "yarn":
        assert "beta_fast" not in params and "truncate" not in params  # yarn's own betas carry over
    stock = load_stock(tmp_path / "ds")
    ids = torch.randint(0, 96, (2, 64), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(stock(ids).logits, model(ids), atol=1e-4, rtol=0)
        if rope == "default":
            prompt = ids[:, :12]
            gen = stock.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=True, pad_token_id=0)
            assert torch.equal(gen, generate(model, prompt, max_new_tokens=6))


# ---- exact without a latent norm, query biases, sliding windows ------------------------------------------


def test_pad_latent_is_exact_without_a_latent_norm(tmp_path):
    """The default "pad" latent: d_c + 1 exported values, the stock norm pinned by a constant coordinate; exact
    in prefill and in stock transformers' cached decode, also on inputs far larger than calibration's."""
    model = _graft(_base(2), kv_lora_rank=24)
    assert not model.config.mla_latent_norm
    with pytest.warns(UserWarning, match="only transformers computes"):
        report = export_deepseek_v3(model, tmp_path / "ds", ExportOptions(target="transformers"), calibration=CAL)
    assert report.latent_norm == "pad" and report.exact and report.kv_lora_rank == 25
    assert report.max_abs_logit_diff <= 1e-4 and report.mean_kl <= 1e-9
    assert report.perplexity["deepseek_v3"] == pytest.approx(report.perplexity["kvgraft"], rel=1e-5)
    raw = json.loads((tmp_path / "ds" / "config.json").read_text())
    assert raw["kv_lora_rank"] == 25 and raw["attention_bias"] is True and raw["kvgraft_export"]["exact"] is True
    assert raw["kvgraft_export"]["target"] == "transformers"
    # why engines need another construction: the pinning constant is beyond fp16 and sits in a bias tensor
    tensors = load_file(str(tmp_path / "ds" / "model.safetensors"))
    assert float(tensors["model.layers.0.self_attn.kv_a_proj_with_mqa.bias"].abs().max()) > 65504
    stock = load_stock(tmp_path / "ds")
    with torch.no_grad():
        torch.testing.assert_close(stock(IDS).logits, model(IDS), atol=1e-4, rtol=0)
        prompt = IDS[:, :12]
        gen = stock.generate(
            prompt,
            max_new_tokens=6,
            do_sample=False,
            use_cache=True,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
        mine = generate(model, prompt, max_new_tokens=6)
        assert torch.equal(gen.sequences, mine)
        full = model(mine)
        for step, logits in enumerate(gen.logits):
            torch.testing.assert_close(logits, full[:, 11 + step], atol=1e-4, rtol=0)
        # the pin holds for any input: embeddings 1000x larger than the model ever saw
        for m in (model, stock.model):
            emb = m.embed_tokens
            emb.weight.mul_(1000)
        try:
            torch.testing.assert_close(stock(IDS).logits, model(IDS), atol=1e-3, rtol=1e-5)
        finally:
            for m in (model, stock.model):
                m.embed_tokens.weight.div_(1000)


def test_qwen2_style_biases_export_exactly(tmp_path):
    """q/k/v/o biases (the query bias too): the query through q_a_proj (bias) -> q_a_layernorm -> q_b_proj with
    q_lora_rank = hidden + 1, exact."""
    model = _graft(_base(2, bias=True, q_bias=True), kv_lora_rank=24)
    assert model.layers[0].self_attn.q_proj.bias.abs().max() > 0
    report = export_deepseek_v3(model, tmp_path / "ds", ExportOptions(target="transformers"), calibration=CAL)
    assert report.exact and report.q_lora_rank == 64 + 1 and report.extra_parameters > 0
    assert any("query bias" in f for f in report.folded)
    assert report.max_abs_logit_diff <= 1e-4, report
    raw = json.loads((tmp_path / "ds" / "config.json").read_text())
    assert raw["q_lora_rank"] == 65 and raw["attention_bias"] is True
    stock = load_stock(tmp_path / "ds")
    assert stock.model.layers[0].self_attn.q_proj is None
    with torch.no_grad():
        exact_err = float((stock(IDS).logits - model(IDS)).abs().max())
        assert exact_err <= 1e-4
        # zeroing the query bias instead (the closest model without the low-rank path) is far worse
        for b in model.layers:
            b.self_attn.q_proj.bias.zero_()
        assert float((stock(IDS).logits - model(IDS)).abs().max()) > 100 * exact_err


def test_sliding_window_is_exact_up_to_the_window(tmp_path):
    model = _graft(_base(2, window=8), kv_lora_rank=24)
    report = export_deepseek_v3(model, tmp_path / "ds", ExportOptions(target="transformers"), calibration=CAL)
    assert not report.exact and report.exact_up_to_tokens == 8
    assert report.max_abs_logit_diff_within_window <= 1e-4
    assert report.max_abs_logit_diff > 1e-3  # CAL is 32 tokens long: beyond the window the two differ
    raw = json.loads((tmp_path / "ds" / "config.json").read_text())
    assert raw["kvgraft_export"]["exact_up_to_tokens"] == 8 and raw["kvgraft_export"]["exact"] is False
    card = (tmp_path / "ds" / "README.md").read_text()
    assert "Exact for contexts up to 8 tokens" in card and "sliding window of 8" in card
    assert any("exact up to 8 tokens" in line for line in report.summary())
    stock = load_stock(tmp_path / "ds")
    with torch.no_grad():
        torch.testing.assert_close(stock(IDS[:, :8]).logits, model(IDS[:, :8]), atol=1e-4, rtol=0)


def test_bfloat16_export_of_the_pinned_constructions(tmp_path):
    """The pinned constants (powers of two) fit bf16; the export loads and tracks the fp32 model."""
    model = _graft(_base(2, bias=True, q_bias=True), kv_lora_rank=24)
    report = export_deepseek_v3(
        model, tmp_path / "ds", ExportOptions(dtype=torch.bfloat16, target="transformers"), calibration=CAL
    )
    assert report.max_abs_logit_diff < 0.1 * float(model(IDS).abs().max()), report


def test_existing_output_needs_overwrite(norm_model, tmp_path):
    out = tmp_path / "ds"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="overwrite"):
        export_deepseek_v3(norm_model, out, ExportOptions(measure=False))
    assert (out / "keep.txt").exists()
    with pytest.raises(ValueError, match="latent_norm"):
        export_deepseek_v3(norm_model, tmp_path / "other", ExportOptions(latent_norm="bogus"))
    report = export_deepseek_v3(norm_model, out, ExportOptions(overwrite=True, measure=False))
    assert report.max_abs_logit_diff is None and not (out / "keep.txt").exists()
    assert (out / "model.safetensors").is_file()


def test_fast_path_warnings():
    small = deepseek_v3_fast_path(_mla_config())  # d_c 24, d_rope 16
    assert len(small) == 2
    assert any("kv_lora_rank" in w and "512" in w for w in small)
    assert any("qk_rope_head_dim" in w and "64" in w for w in small)
    wide = deepseek_v3_fast_path(_mla_config(kv_lora_rank=64))  # 64 + 16 > 2 * 2 * 16
    assert any("larger than the original" in w and "80" in w for w in wide)
    assert not any("larger" in w for w in small)
    assert any("larger" in w for w in deepseek_v3_fast_path(_mla_config(), original_kv_width=32))
    flash = deepseek_v3_fast_path(
        _mla_config(hidden_size=128, head_dim=128, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128),
        original_kv_width=1024,
    )
    assert flash == []


# ---- the engine-safe default (what vLLM and SGLang load) --------------------------------------------------


def test_engine_safe_default_writes_no_bias_and_stays_in_fp16(tmp_path):
    """The default target: no bias tensor (vLLM/SGLang build the projections bias=False and skip them),
    attention_bias false, every weight within fp16's range; q/k/v/o biases folded into the weights through the
    input's mean direction and kv_b's constant-value column, which must beat simply dropping them."""
    from kvgraft.hf.deepseek import measure_export

    model = _graft(_base(2, bias=True, q_bias=True), kv_lora_rank=24)
    report = export_deepseek_v3(model, tmp_path / "ds", calibration=CAL_FIT)
    assert report.target == "engines" and report.latent_norm == "fit" and report.q_lora_rank is None
    assert not report.exact and any("attention biases" in a for a in report.approximations)
    raw = json.loads((tmp_path / "ds" / "config.json").read_text())
    assert raw["attention_bias"] is False and raw["kv_lora_rank"] == 24 and raw["kvgraft_export"]["target"] == "engines"
    tensors = load_file(str(tmp_path / "ds" / "model.safetensors"))
    assert not [k for k in tensors if k.endswith(".bias")]
    assert max(float(t.abs().max()) for t in tensors.values()) <= 65504
    _, info = AutoModelForCausalLM.from_pretrained(tmp_path / "ds", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    # the same export with the biases dropped instead of folded, measured against the biased model
    dropped = _graft(_base(2, bias=True, q_bias=True), kv_lora_rank=24)
    with torch.no_grad():
        for b in dropped.layers:
            for name in ("q_proj", "kv_a_proj", "kv_b_proj", "o_proj"):
                bias = getattr(b.self_attn, name).bias
                if bias is not None:
                    bias.zero_()
    export_deepseek_v3(dropped, tmp_path / "dropped", ExportOptions(measure=False), calibration=CAL_FIT)
    ids = CAL_FIT[-8:]
    folded_kl = measure_export(model, tmp_path / "ds", ids)["mean_kl"]
    dropped_kl = measure_export(model, tmp_path / "dropped", ids)["mean_kl"]
    assert folded_kl < 0.5 * dropped_kl, (folded_kl, dropped_kl)


def test_engine_safe_latent_model_is_exact(norm_model, tmp_path):
    """A graft with its own latent norm and no biases exports exactly for engines too."""
    report = export_deepseek_v3(norm_model, tmp_path / "ds", calibration=CAL)
    assert report.target == "engines" and report.exact and report.max_abs_logit_diff <= 1e-4


def test_engine_and_transformers_targets_are_checked(tmp_path):
    model = _graft(_base(2, bias=True, q_bias=True), kv_lora_rank=24)
    with pytest.raises(ValueError, match="target 'vllm' is not one of engines, transformers"):
        export_deepseek_v3(model, tmp_path / "a", ExportOptions(target="vllm"), calibration=CAL)
    with pytest.raises(ValueError, match="latent_norm 'pad' .* vLLM"):
        export_deepseek_v3(model, tmp_path / "b", ExportOptions(latent_norm="pad"), calibration=CAL)
    with pytest.raises(ValueError, match="attention biases: .* pass calibration token ids"):
        export_deepseek_v3(model, tmp_path / "c")
    assert not any((tmp_path / n).exists() for n in "abc")
    with pytest.warns(UserWarning, match="vLLM and SGLang skip attention biases"):
        export_deepseek_v3(model, tmp_path / "d", ExportOptions(target="transformers", measure=False), calibration=CAL)
