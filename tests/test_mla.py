"""MLA graft and runtime: exactness at full budget, absorbed == expanded, error falls with rank, cache size."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvgraft.graft.mla import GraftConfig, graft_mla
from kvgraft.model import ModelConfig, RopeConfig, Transformer


def _model(num_kv_heads: int, bias: bool = False, window: int | None = None, seed: int = 0) -> Transformer:
    cfg = ModelConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=num_kv_heads,
        head_dim=16,
        max_position_embeddings=64,
        qkv_bias=bias,
        o_bias=bias,
        sliding_window=window,
    )
    model = Transformer(cfg).eval()
    model.init_weights(seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "bias" in name:  # non-zero biases so their folding is really exercised
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
            elif "norm" in name:
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
    return model


def _calibration(n: int = 8, t: int = 32, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 96, (n, t), generator=torch.Generator().manual_seed(seed))


IDS = torch.randint(0, 96, (2, 28), generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1], ids=["MHA", "GQA2", "MQA"])
@pytest.mark.parametrize("objective", ["weights", "activations", "attention"])
@pytest.mark.parametrize("selection", ["norm", "stride"])
def test_full_budget_is_exact(num_kv_heads, objective, selection):
    """Latent rank = KV width and RoPE kept on every head's frequencies: the graft is exact."""
    model = _model(num_kv_heads, bias=num_kv_heads == 2)
    d_rope = num_kv_heads * 16 if selection == "norm" else 16
    if selection == "stride" and num_kv_heads > 1:
        pytest.skip("stride keeps one rotated head: exact only for MQA")
    g = GraftConfig(kv_lora_rank=2 * num_kv_heads * 16, qk_rope_head_dim=d_rope, objective=objective, rope_selection=selection)
    new = graft_mla(model, g, _calibration(), progress=False).eval()
    with torch.no_grad():
        torch.testing.assert_close(new(IDS), model(IDS), atol=1e-4, rtol=0)
    assert new.config.attention_kinds == ("mla", "mla")


@pytest.mark.parametrize(
    "rope",
    [
        dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16),
        dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16),
        dict(rope_type="linear", factor=2.0),
    ],
)
def test_full_budget_exact_with_rope_scaling(rope):
    model = _model(2)
    cfg = model.config.replace(rope=RopeConfig(**rope), max_position_embeddings=64)
    scaled = Transformer(cfg).eval()
    scaled.load_state_dict(model.state_dict())
    g = GraftConfig(kv_lora_rank=64, qk_rope_head_dim=32, objective="activations", rope_selection="norm")
    new = graft_mla(scaled, g, _calibration(), progress=False).eval()
    with torch.no_grad():
        torch.testing.assert_close(new(IDS), scaled(IDS), atol=1e-4, rtol=0)


def test_yarn_attention_factor_is_folded_into_the_no_rope_query(monkeypatch):
    """YaRN multiplies every logit by its factor squared; pairs that lose RoPE must keep that factor.

    At position 0 for every token RoPE rotates nothing, so dropping it is exact there: the graft must
    then match the original exactly, which it does only with the factor folded into the query.
    """
    import kvgraft.graft.mla as graft_module

    model = _model(2)
    cfg = model.config.replace(
        rope=RopeConfig(rope_type="yarn", factor=8.0, original_max_position_embeddings=8), max_position_embeddings=64
    )
    scaled = Transformer(cfg).eval()
    scaled.load_state_dict(model.state_dict())
    assert scaled.rotary.attention_scaling > 1.2
    # half the pairs lose RoPE; no expected-rotation stand-in (it is measured at real positions)
    g = GraftConfig(kv_lora_rank=64, qk_rope_head_dim=16, objective="activations", rope_expectation=False)
    zeros = torch.zeros_like(IDS)

    def error(new):
        with torch.no_grad():
            return (new(IDS, positions=zeros) - scaled(IDS, positions=zeros)).abs().max().item()

    assert error(graft_mla(scaled, g, _calibration(), progress=False).eval()) < 1e-4
    real = graft_module.convert_layer
    monkeypatch.setattr(
        graft_module, "convert_layer", lambda w, spec, **k: real(w, dataclasses.replace(spec, rope_attention_scaling=1.0), **k)
    )
    assert error(graft_mla(scaled, g, _calibration(), progress=False).eval()) > 1e-3


def test_full_budget_exact_with_sliding_window():
    model = _model(2, window=8)
    g = GraftConfig(kv_lora_rank=64, qk_rope_head_dim=32, objective="activations", rope_selection="norm")
    new = graft_mla(model, g, _calibration(), progress=False).eval()
    with torch.no_grad():
        torch.testing.assert_close(new(IDS), model(IDS), atol=1e-4, rtol=0)
        cache = new.new_cache(2, 28)
        steps = [new(IDS[:, :12], cache=cache)] + [new(IDS[:, t : t + 1], cache=cache) for t in range(12, 28)]
        torch.testing.assert_close(torch.cat(steps, 1), model(IDS), atol=1e-4, rtol=0)


@pytest.mark.parametrize("num_kv_heads", [4, 2])
@pytest.mark.parametrize("rank", [24, 8])  # d_c above the head width (no folds) and below it (folds)
@pytest.mark.parametrize("grad", [False, True])  # inference folds W_UK/W_UV; with autograd they stay apart
def test_absorbed_decode_equals_expanded(num_kv_heads, rank, grad):
    model = _model(num_kv_heads, bias=True)
    new = graft_mla(model, GraftConfig(kv_lora_rank=rank, qk_rope_head_dim=16), _calibration(), progress=False).eval()
    assert new.layers[0].self_attn.fold_q == (rank <= 16) and new.layers[0].self_attn.fold_o == (rank <= 16)
    with torch.set_grad_enabled(grad):
        full = new(IDS).detach()  # no cache: expanded path
        for mode in ("always", "never"):
            for layer in new.layers:
                layer.self_attn.absorb = mode
            cache = new.new_cache(2, 28)
            steps = [new(IDS[:, :9], cache=cache)] + [new(IDS[:, t : t + 1], cache=cache) for t in range(9, 28)]
            torch.testing.assert_close(torch.cat(steps, 1).detach(), full, atol=1e-5, rtol=0)


def test_folded_decode_follows_weight_updates():
    """The folded decode weights are rebuilt when the underlying parameters change."""
    new = graft_mla(_model(2), GraftConfig(kv_lora_rank=8, qk_rope_head_dim=16), _calibration(), progress=False).eval()
    with torch.no_grad():
        cache = new.new_cache(2, 28)
        new(IDS[:, :9], cache=cache)
        new(IDS[:, 9:10], cache=cache)  # builds the folded weights
        for layer in new.layers:
            layer.self_attn.kv_b_proj.weight.mul_(1.5)
            layer.self_attn.o_proj.weight.add_(0.01)
        cache = new.new_cache(2, 28)
        steps = [new(IDS[:, :9], cache=cache)] + [new(IDS[:, t : t + 1], cache=cache) for t in range(9, 28)]
        torch.testing.assert_close(torch.cat(steps, 1), new(IDS), atol=1e-5, rtol=0)


def _calibration_error(model, new, ids) -> float:
    with torch.no_grad():
        return (new(ids) - model(ids)).pow(2).mean().item()


@pytest.mark.parametrize("objective", ["activations", "attention"])
def test_one_shot_error_does_not_grow_with_rank(objective):
    model = _model(2)
    calib = _calibration(16)
    errors = []
    for rank in (4, 8, 16, 32, 48, 64):
        g = GraftConfig(kv_lora_rank=rank, qk_rope_head_dim=32, objective=objective, rope_selection="norm")
        errors.append(_calibration_error(model, graft_mla(model, g, calib, progress=False).eval(), calib))
    assert all(b <= a * 1.02 + 1e-9 for a, b in zip(errors, errors[1:])), errors
    assert errors[-1] < 1e-8 < errors[0]


def test_activation_aware_beats_weights_only_on_calibration_text():
    model = _model(2)
    calib = _calibration(16)
    err = {}
    for objective in ("weights", "activations"):
        g = GraftConfig(kv_lora_rank=12, qk_rope_head_dim=16, objective=objective, layerwise=False)
        err[objective] = _calibration_error(model, graft_mla(model, g, calib, progress=False).eval(), calib)
    assert err["activations"] < err["weights"]


def test_progressive_grafting_converts_only_chosen_layers():
    model = _model(2)
    g = GraftConfig(kv_lora_rank=16, qk_rope_head_dim=16, layers=(1,))
    new = graft_mla(model, g, _calibration(), progress=False).eval()
    assert new.config.attention_kinds == ("gqa", "mla")
    for key, value in model.layers[0].state_dict().items():
        torch.testing.assert_close(new.layers[0].state_dict()[key], value)


@pytest.mark.parametrize("dtype,nbytes", [(torch.float32, 4), (torch.bfloat16, 2)])
def test_latent_cache_bytes_equal_the_formula(dtype, nbytes):
    model = _model(2)
    new = graft_mla(model, GraftConfig(kv_lora_rank=24, qk_rope_head_dim=16), _calibration(), progress=False)
    cache = new.new_cache(3, 48, dtype=dtype)  # whole blocks of 16 tokens
    per_layer = 24 + 16  # d_c + d_rope values per token per layer
    assert cache.bytes_per_token() == new.config.kv_bytes_per_token(nbytes) == 2 * per_layer * nbytes


def test_bad_graft_configs_name_the_value():
    model = _model(2)
    with pytest.raises(ValueError, match=r"qk_rope_head_dim \(64\) exceeds"):
        graft_mla(model, GraftConfig(kv_lora_rank=16, qk_rope_head_dim=64), _calibration(), progress=False)
    with pytest.raises(ValueError, match=r"kv_lora_rank \(65\) exceeds"):
        graft_mla(model, GraftConfig(kv_lora_rank=65, qk_rope_head_dim=16), _calibration(), progress=False)
    with pytest.raises(ValueError, match=r"layers \[5\] out of range"):
        graft_mla(model, GraftConfig(kv_lora_rank=16, qk_rope_head_dim=16, layers=(5,)), _calibration())
    with pytest.raises(ValueError, match="needs calibration tokens"):
        graft_mla(model, GraftConfig(kv_lora_rank=16, qk_rope_head_dim=16), None)
    with pytest.raises(ValueError, match="objective 'svd'"):
        GraftConfig(kv_lora_rank=16, qk_rope_head_dim=16, objective="svd")
    with pytest.raises(ValueError, match=r"qk_rope_head_dim \(7\)"):
        GraftConfig(kv_lora_rank=16, qk_rope_head_dim=7)


def _qwen3_like(seed: int = 0) -> Transformer:
    cfg = ModelConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        qk_norm=True,
    )
    model = Transformer(cfg).eval()
    model.init_weights(seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            elif "q_proj" in name or "k_proj" in name:
                p.mul_(8)  # sharp attention, so that key errors matter
    return model


def test_qwen3_query_norm_is_kept_and_key_norm_linearised():
    """Qwen3 keys are k_norm(W_k x): not linear in x, so no latent reproduces them exactly. The graft keeps
    the query norm exactly, fits the key norm by least squares, and beats ignoring the key norm."""
    model = _qwen3_like()
    calib = _calibration(16)
    g = GraftConfig(kv_lora_rank=64, qk_rope_head_dim=32, objective="activations", rope_selection="norm")
    new = graft_mla(model, g, calib, progress=False).eval()
    assert new.config.qk_norm and all(hasattr(layer.self_attn, "q_mix") for layer in new.layers)
    fitted = _calibration_error(model, new, IDS)

    import kvgraft.graft.layer_stats as graft_module

    def identity_keys(block, x, C, batch_size):  # pretend the key norm were not there
        return block.self_attn.k_proj.weight.detach().double()

    original = graft_module.linearised_keys
    graft_module.linearised_keys = identity_keys
    try:
        ignored = _calibration_error(model, graft_mla(model, g, calib, progress=False).eval(), IDS)
    finally:
        graft_module.linearised_keys = original
    print(f"qwen3 graft error: fitted key norm {fitted:.3e}, ignored {ignored:.3e}")
    assert fitted < 0.5 * ignored, (fitted, ignored)
    weights_only = graft_mla(
        model, GraftConfig(kv_lora_rank=64, qk_rope_head_dim=32, objective="weights", rope_selection="norm"), None, progress=False
    ).eval()
    assert _calibration_error(model, weights_only, IDS) < ignored


@pytest.mark.parametrize("rank", [24, 8])
def test_qwen3_graft_round_trips_in_kvgraft_format(tmp_path, rank):
    from kvgraft.hf import load_pretrained, save_pretrained

    new = graft_mla(_qwen3_like(), GraftConfig(kv_lora_rank=rank, qk_rope_head_dim=16), _calibration(), progress=False).eval()
    back = load_pretrained(save_pretrained(new, tmp_path / "q3", model_type="kvgraft"))
    with torch.no_grad():
        torch.testing.assert_close(back(IDS), new(IDS), atol=0, rtol=0)
        cache = back.new_cache(2, 28)
        steps = [back(IDS[:, :9], cache=cache)] + [back(IDS[:, t : t + 1], cache=cache) for t in range(9, 28)]
        torch.testing.assert_close(torch.cat(steps, 1), new(IDS), atol=1e-5, rtol=0)


def test_rope_expectation_is_the_expected_logit_of_a_dropped_pair():
    """For one query/key and a distance profile p, E_p[RoPE(q).RoPE(k)] == (M^T q) . k exactly."""
    from kvgraft.graft.layer_stats import rope_expectation
    from kvgraft.model.rope import apply_rope

    g = torch.Generator().manual_seed(0)
    theta = torch.tensor([1.0, 0.3, 0.05, 0.001], dtype=torch.float64)
    q, k = torch.randn(8, generator=g, dtype=torch.float64), torch.randn(8, generator=g, dtype=torch.float64)
    profile = torch.rand(20, generator=g, dtype=torch.float64)
    profile /= profile.sum()

    def rope(x, pos):
        ang = pos * theta
        cos, sin = torch.cat([ang.cos(), ang.cos()]), torch.cat([ang.sin(), ang.sin()])
        return apply_rope(x[None, None, None], cos[None, None], sin[None, None])[0, 0, 0]

    expected = sum(profile[delta] * (rope(q, 25) @ rope(k, 25 - delta)) for delta in range(20))
    c, s = rope_expectation(profile, theta).unbind(-1)
    folded = torch.cat([c * q[:4] - s * q[4:], s * q[:4] + c * q[4:]])
    assert abs(float(folded @ k) - float(expected)) < 1e-12


def test_rope_expectation_lowers_the_one_shot_error():
    model = _model(2)
    with torch.no_grad():  # sharp attention, so that position matters
        for layer in model.layers:
            layer.self_attn.q_proj.weight.mul_(6)
            layer.self_attn.k_proj.weight.mul_(6)
    calib = _calibration(16)
    err = {}
    for on in (False, True):
        g = GraftConfig(kv_lora_rank=64, qk_rope_head_dim=8, objective="activations", rope_expectation=on)
        err[on] = _calibration_error(model, graft_mla(model, g, calib, progress=False).eval(), calib)
    assert err[True] < err[False], err
