"""The local refinement of each grafted attention (``kvgraft convert --refine-epochs``, kvgraft.graft.refine) and
the graft's own latent norm (``--latent-norm``, the default for a stock export).

Refinement trains each converted attention alone against the original stack's residual stream: it must lower
the layer's error on the calibration tail it never trained on, and the converted model's perplexity there; it
runs the same in both executors and after a resume (bit for bit). A graft with its own latent norm exports to
stock DeepSeek-V3 exactly (tests/test_export_tolerance.py measures ~1e-9 with the engine-safe construction).
"""

from __future__ import annotations

import json

import pytest
import torch
from test_convert_layerwise import _assert_same, _both, _checkpoint
from test_convert_resume import _interrupted_then_resumed

from kvgraft.cli import EXIT_ERROR, main
from kvgraft.graft.convert import execute
from kvgraft.graft.options import ConvertOptions
from kvgraft.graft.plan import plan_conversion
from kvgraft.graft.refine import RefineConfig
from kvgraft.hf import load_pretrained

OPTIONS = dict(progress=False, calibration_tokens=1024, calibration_seq_len=32)


def test_refinement_lowers_each_layers_held_out_error_and_the_tail_perplexity(tmp_path):
    path = _checkpoint(tmp_path, "llama")
    plain = execute(plan_conversion(path, tmp_path / "plain", ConvertOptions(**OPTIONS))).to_dict()
    refined = execute(
        plan_conversion(path, tmp_path / "refined", ConvertOptions(refine_epochs=6, refine_lr=3e-3, **OPTIONS))
    ).to_dict()
    assert plain["calibration_tail"].get("refinement") is None
    record = refined["calibration_tail"]["refinement"]
    assert record["epochs"] == 6 and record["lr"] == 3e-3 and refined["graft"]["refine_epochs"] == 6
    layers = record["layers"]
    assert sorted(layers) == ["0", "1", "2"]
    for layer, r in layers.items():
        assert r["steps"] == 6 * 24, layer  # 32 sequences of 32 tokens, the last 8 held out, batches of 1
        assert r["after"] < r["before"], (layer, r)
    ppl = {name: rec["calibration_tail"]["converted_perplexity"] for name, rec in (("plain", plain), ("refined", refined))}
    assert ppl["refined"] < ppl["plain"], ppl
    # only the attention changed: norms, MLP and embeddings are the original's
    a, b = load_pretrained(tmp_path / "plain"), load_pretrained(tmp_path / "refined")
    sa, sb = a.state_dict(), b.state_dict()
    for name in sa:
        same = torch.equal(sa[name], sb[name])
        assert same == (".self_attn." not in name), name


def test_refinement_trains_the_latent_norm_it_grafts(tmp_path):
    path = _checkpoint(tmp_path, "llama")
    execute(plan_conversion(path, tmp_path / "init", ConvertOptions(latent_norm=True, refine_epochs=0, **OPTIONS)))
    execute(plan_conversion(path, tmp_path / "trained", ConvertOptions(latent_norm=True, refine_epochs=2, **OPTIONS)))
    init, trained = load_pretrained(tmp_path / "init"), load_pretrained(tmp_path / "trained")
    assert init.config.mla_latent_norm and trained.config.mla_latent_norm
    w0 = init.layers[0].self_attn.kv_a_norm.weight
    w1 = trained.layers[0].self_attn.kv_a_norm.weight
    # initialised to one constant (the latent's mean rms on the calibration text), then trained per coordinate
    assert torch.all(w0 == w0[0]) and float(w0[0]) > 0 and not torch.equal(w0, w1)


def test_refined_graft_is_the_same_in_both_executors(tmp_path):
    whole, layer, a, b = _both(tmp_path, _checkpoint(tmp_path, "qwen2"), refine_epochs=1)
    _assert_same(whole, layer, a, b)
    assert whole["calibration_tail"]["refinement"] == layer["calibration_tail"]["refinement"]


def test_refined_graft_resumes_bit_for_bit(tmp_path, monkeypatch):
    reference, resumed, a, b = _interrupted_then_resumed(
        tmp_path, monkeypatch, _checkpoint(tmp_path, "llama"), 1, refine_epochs=1
    )
    _assert_same(reference, resumed, a, b)
    assert resumed["calibration_tail"]["refinement"] == reference["calibration_tail"]["refinement"]


def test_stock_export_grafts_a_latent_norm_by_default_and_exports_exactly(tmp_path):
    path = _checkpoint(tmp_path, "llama")
    record = execute(plan_conversion(path, tmp_path / "out", ConvertOptions(output_format="both", **OPTIONS))).to_dict()
    assert record["graft"]["latent_norm"] is True
    assert record["graft"]["refine_epochs"] == 4  # the norm starts as a constant scale: refined by default
    assert record["calibration_tail"]["refinement"]["epochs"] == 4
    assert record["deepseek_v3"]["exact"] is True
    assert record["deepseek_v3"]["error_check"]["relative_perplexity_difference"] < 1e-6
    plain = execute(plan_conversion(path, tmp_path / "kvgraft", ConvertOptions(**OPTIONS))).to_dict()
    assert plain["graft"]["latent_norm"] is False and plain["graft"]["refine_epochs"] == 0  # kvgraft format: neither


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(refine_epochs=-1), "refine_epochs (-1) must be a non-negative integer"),
        (dict(refine_epochs=True), "refine_epochs (True)"),
        (dict(refine_epochs=1, refine_lr=0.0), "refine_lr (0.0) must be a positive finite number"),
        (dict(refine_epochs=1, refine_lr=float("nan")), "refine_lr (nan)"),
        (dict(refine_epochs=1, objective="weights"), "objective 'weights' reads none"),
        (dict(to="ced", latent_norm=True), "takes no latent norm"),
    ],
)
def test_bad_refinement_options_are_refused_on_construction(options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ConvertOptions(**options)


def test_bad_refine_config_values():
    with pytest.raises(ValueError, match="batch_sequences"):
        RefineConfig(batch_sequences=0)
    with pytest.raises(ValueError, match="lr"):
        RefineConfig(lr=-1.0)


def test_cli_refuses_a_bad_refinement_before_any_work(tmp_path, capsys):
    path = _checkpoint(tmp_path, "llama")
    out = tmp_path / "out"
    assert main(["convert", str(path), "--out", str(out), "--refine-epochs", "-2"]) == EXIT_ERROR
    assert "refine_epochs (-2)" in capsys.readouterr().err and not out.exists()
    assert (
        main(
            [
                "convert",
                str(path),
                "--out",
                str(out),
                "--refine-epochs",
                "1",
                "--refine-lr",
                "1e-3",
                "--calibration-tokens",
                "1024",
            ]
        )
        == 0
    )
    assert json.loads((out / "conversion.json").read_text())["graft"]["refine_epochs"] == 1
