"""The share graft (`kvgraft convert --to ced`): exact where the math is exact, least squares where it
is not, real transformers checkpoints in, clear errors for what it cannot do."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers

from kvgraft.cli import main
from kvgraft.graft.ced import CEDGraftConfig, default_kv_sources, graft_ced
from kvgraft.graft.mla import GraftConfig, graft_mla
from kvgraft.hf import load_pretrained
from kvgraft.model.presets import get_preset
from kvgraft.model.transformer import Transformer

CALIB = torch.randint(0, 512, (12, 48), generator=torch.Generator().manual_seed(0))
IDS = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(1))


def mla_model(**changes) -> Transformer:
    cfg = get_preset("llama-tiny").replace(num_layers=4, **changes)
    torch.manual_seed(0)
    base = Transformer(cfg)
    base.init_weights(0)
    with torch.no_grad():  # larger weights: attention patterns far from uniform
        for name, p in base.named_parameters():
            if "q_proj" in name or "k_proj" in name:
                p.mul_(6)
    g = GraftConfig(kv_lora_rank=32, qk_rope_head_dim=cfg.head_dim, objective="activations", rope_selection="stride")
    return graft_mla(base.eval(), g, CALIB, progress=False).eval()


@pytest.mark.parametrize("bias", [False, True])
def test_every_layer_a_source_reproduces_the_mla_model_exactly(bias):
    mla = mla_model(qkv_bias=bias)
    ced, report = graft_ced(mla, CEDGraftConfig(kv_source_layers=(0, 1, 2, 3), sliding_window=4), CALIB, progress=False)
    assert ced.config.is_ced and ced.config.num_kv_heads == mla.config.num_heads
    assert report["readers"] == {}  # nothing to fit: every layer reads its own latent
    with torch.no_grad():
        torch.testing.assert_close(ced.eval()(IDS), mla(IDS), atol=1e-4, rtol=0)


def test_least_squares_readers_beat_reading_with_their_own_up_projection():
    mla = mla_model()
    g = CEDGraftConfig(kv_source_layers=(1,), sliding_window=6)
    ced, report = graft_ced(mla, g, CALIB, progress=False)
    assert set(report["readers"]) == {2, 3}
    assert all(0 <= r["relative_residual"] < 1 for r in report["readers"].values())
    naive = Transformer(ced.config)
    naive.load_state_dict(ced.state_dict())
    with torch.no_grad():
        for layer in (2, 3):  # a reader that applies its own kv_b to the source's latent
            naive.layers[layer].self_attn.kv_b_proj.weight.copy_(mla.layers[layer].self_attn.kv_b_proj.weight)
        want = mla(CALIB)
        fitted = (ced.eval()(CALIB) - want).pow(2).mean()
        unfitted = (naive.eval()(CALIB) - want).pow(2).mean()
    assert fitted < 0.8 * unfitted, (fitted, unfitted)


def test_pooled_sources_fit_their_own_latent_with_zero_gates():
    mla = mla_model()
    ced, report = graft_ced(
        mla, CEDGraftConfig(kv_source_layers=(0, 2), sliding_window=8, compress_rate=2), CALIB, progress=False
    )
    # a source reading its own mean-pooled latent: the fitted map is the identity (tiny ridge)
    assert report["readers"][0]["relative_residual"] < 1e-4
    assert report["readers"][2]["relative_residual"] < 1e-4
    gate = ced.layers[0].self_attn.compressor.gate_proj.weight
    assert torch.count_nonzero(gate) == 0
    with torch.no_grad():
        assert torch.isfinite(ced.eval()(IDS)).all()


def test_errors_name_what_is_wrong():
    mla = mla_model()
    with pytest.raises(ValueError, match="every layer is MLA"):
        graft_ced(Transformer(get_preset("llama-tiny")), CEDGraftConfig((0,)), CALIB, progress=False)
    uneven = Transformer(mla.config.replace(rope_freq_index=(tuple(range(8)),) * 3 + ((1, 0, 2, 3, 4, 5, 6, 7),)))
    with pytest.raises(ValueError, match="one layout"):
        graft_ced(uneven, CEDGraftConfig((0,)), CALIB, progress=False)
    with pytest.raises(ValueError, match="strictly increasing"):
        graft_ced(mla, CEDGraftConfig((2, 1)), CALIB, progress=False)


def test_default_sources():
    assert default_kv_sources(8) == (1, 3, 4)
    assert default_kv_sources(40) == (7, 13, 19, 20)
    assert default_kv_sources(2) == (1,)
    for n in range(2, 64):
        src = default_kv_sources(n)
        assert list(src) == sorted(set(src)) and src[-1] == n // 2 and src[0] >= 0


def test_convert_cli_from_a_transformers_checkpoint(tmp_path):
    cfg = transformers.AutoConfig.for_model(
        "qwen2",
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
    )
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    path = tmp_path / "qwen2"
    hf.save_pretrained(path)
    (path / "eval").mkdir()
    np.save(path / "eval" / "calibration.npy", np.random.default_rng(0).integers(0, 96, 4096).astype(np.uint16))
    out = tmp_path / "ced"
    assert (
        main(["convert", str(path), "--to", "ced", "--out", str(out), "--sliding-window", "8", "--calibration-tokens", "2048"])
        == 0
    )
    ced = load_pretrained(out)
    assert ced.config.kv_source_layers == (1, 2) and ced.config.sliding_window == 8
    record = json.loads((out / "conversion.json").read_text())
    assert record["to"] == "ced" and set(record["share_graft"]["readers"]) == {"3"}
    ids = torch.randint(0, 96, (2, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.isfinite(ced(ids)).all()
        # the cache path agrees with the full forward on the converted model
        cache = ced.new_cache(2, 30)
        inc = torch.cat([ced(ids[:, :10], cache=cache)] + [ced(ids[:, i : i + 1], cache=cache) for i in range(10, 30)], 1)
        torch.testing.assert_close(inc, ced(ids), atol=1e-4, rtol=0)
    # formats and RoPE layouts a causal encoder-decoder cannot have are refused
    assert main(["convert", str(path), "--to", "ced", "--out", str(tmp_path / "x"), "--format", "both"]) == 2
    assert main(["convert", str(path), "--to", "ced", "--out", str(tmp_path / "y"), "--rope-selection", "norm"]) == 2


def test_convert_an_mla_graft_with_one_rope_layout(tmp_path):
    cfg = get_preset("llama-tiny").replace(num_layers=3)
    model = Transformer(cfg)
    model.init_weights(0)
    from kvgraft.hf import save_pretrained

    save_pretrained(model, tmp_path / "llama")
    (tmp_path / "llama" / "eval").mkdir()
    np.save(tmp_path / "llama" / "eval" / "calibration.npy", CALIB.flatten().numpy().astype(np.uint16))
    assert (
        main(
            [
                "convert",
                str(tmp_path / "llama"),
                "--out",
                str(tmp_path / "mla"),
                "--rope-selection",
                "stride",
                "--kv-lora-rank",
                "24",
                "--calibration-tokens",
                "512",
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "convert",
                str(tmp_path / "mla"),
                "--to",
                "ced",
                "--out",
                str(tmp_path / "ced"),
                "--kv-source-layers",
                "0",
                "1",
                "2",
                "--sliding-window",
                "4",
                "--calibration-tokens",
                "512",
            ]
        )
        == 0
    )
    mla, ced = load_pretrained(tmp_path / "mla"), load_pretrained(tmp_path / "ced")
    assert json.loads((tmp_path / "ced" / "conversion.json").read_text())["graft"] is None
    with torch.no_grad():
        torch.testing.assert_close(ced(IDS[:, :30] % 512), mla(IDS[:, :30] % 512), atol=1e-4, rtol=0)


def test_shared_rope_selection_gives_one_layout():
    from kvgraft.graft.mla_math import shared_rope_pairs

    # two layers, 2 rotated heads x 4 frequencies: the slots with the largest summed normalised scores
    a = torch.tensor([[4.0, 0.1, 3.0, 0.2], [2.0, 0.05, 1.0, 0.1]])
    b = torch.tensor([[0.1, 1.0, 0.2, 5.0], [0.05, 0.5, 0.1, 4.0]])  # its heads are ranked the other way
    pairs = shared_rope_pairs([a, b.flip(0)], d_rope=4)
    assert [f for _, f in pairs[0]] == [f for _, f in pairs[1]]
    assert pairs[0] == [(0, 0), (0, 3)] and pairs[1] == [(1, 0), (1, 3)]  # each layer its own strongest head
    cfg = get_preset("llama-tiny").replace(num_layers=3, qkv_bias=True)
    torch.manual_seed(0)
    base = Transformer(cfg)
    base.init_weights(0)
    for sel in ("stride", "shared"):
        g = GraftConfig(kv_lora_rank=32, qk_rope_head_dim=8, objective="attention", rope_selection=sel)
        mla = graft_mla(base.eval(), g, CALIB, progress=False).eval()
        assert len(set(mla.config.rope_freq_index)) == 1
        ced, _ = graft_ced(mla, CEDGraftConfig((0, 1, 2), sliding_window=4), CALIB, progress=False)
        with torch.no_grad():
            torch.testing.assert_close(ced.eval()(CALIB), mla(CALIB), atol=1e-4, rtol=0)


def test_rope_fit_keeps_the_window_and_brings_the_readers_closer():
    mla = mla_model()
    short = IDS[:, :6]  # within the window: no shared entry is visible, the windows alone answer
    outs = {}
    for fit in (False, True):
        g = CEDGraftConfig(kv_source_layers=(1,), sliding_window=6, rope_fit=fit)
        ced, report = graft_ced(mla, g, CALIB, progress=False)
        with torch.no_grad():
            outs[fit] = (ced.eval()(short), (ced(CALIB) - mla(CALIB)).pow(2).mean())
        if fit:
            assert all(0 <= r["rope_relative_residual"] < 1 for r in report["readers"].values())
        else:
            assert all("rope_relative_residual" not in r for r in report["readers"].values())
    torch.testing.assert_close(outs[True][0], outs[False][0], atol=1e-4, rtol=0)
    with torch.no_grad():
        torch.testing.assert_close(outs[True][0], mla(short), atol=1e-4, rtol=0)
    assert outs[True][1] < outs[False][1], (outs[True][1], outs[False][1])
