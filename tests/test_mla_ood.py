"""Calibration shrinkage of the MLA graft, and the out-of-domain evaluation text builder."""

from __future__ import annotations

import gzip
import math

import numpy as np
import pytest
import torch

from kvgraft.data import ood
from kvgraft.graft.layer_stats import shrink_second_moment
from kvgraft.graft.mla import GraftConfig, graft_mla
from kvgraft.model import ModelConfig, Transformer


def _model(seed: int = 0) -> Transformer:
    cfg = ModelConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=64,
    )
    model = Transformer(cfg).eval()
    model.init_weights(seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # an anisotropic attention input, so calibration really differs from weights only
                p.copy_(torch.rand(p.shape, generator=gen) * 2 + 0.1)
    return model


CALIB = torch.randint(0, 96, (8, 32), generator=torch.Generator().manual_seed(1))
IDS = torch.randint(0, 96, (2, 28), generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("bad", [-0.1, 1.5, math.nan, True, "0.5"])
def test_bad_shrinkage_is_refused(bad):
    with pytest.raises(ValueError, match="calibration_shrinkage"):
        GraftConfig(kv_lora_rank=16, qk_rope_head_dim=8, calibration_shrinkage=bad)


def test_shrink_second_moment_keeps_trace_and_endpoints():
    a = torch.randn(40, 6, dtype=torch.float64)
    C = a.T @ a / 40
    assert shrink_second_moment(C, 0.0) is C
    assert shrink_second_moment(None, 0.5) is None
    full = shrink_second_moment(C, 1.0)
    torch.testing.assert_close(full, torch.eye(6, dtype=C.dtype) * torch.trace(C) / 6)
    half = shrink_second_moment(C, 0.5)
    torch.testing.assert_close(torch.trace(half), torch.trace(C))
    torch.testing.assert_close(half, (C + full) / 2)


def test_full_shrinkage_is_the_weights_only_fit():
    """Shrinkage 1 replaces C by a multiple of I; the factorisation is scale-free, so the activation-aware
    graft (without RoPE expectation, which uses the text elsewhere) equals the weights-only one."""
    model = _model()
    common = {"kv_lora_rank": 24, "qk_rope_head_dim": 8, "rope_selection": "norm", "rope_expectation": False}
    weights = graft_mla(model, GraftConfig(objective="weights", **common), None, progress=False).eval()
    shrunk = graft_mla(
        model, GraftConfig(objective="activations", calibration_shrinkage=1.0, **common), CALIB, progress=False
    ).eval()
    calibrated = graft_mla(
        model, GraftConfig(objective="activations", calibration_shrinkage=0.0, **common), CALIB, progress=False
    ).eval()
    with torch.no_grad():
        torch.testing.assert_close(shrunk(IDS), weights(IDS), atol=1e-4, rtol=0)
        assert (calibrated(IDS) - weights(IDS)).abs().max() > 1e-3  # the option really changes the fit


def test_default_shrinkage_is_half_and_used():
    """The default (what ``kvgraft convert`` builds) shrinks by 0.5 and gives another graft than 0."""
    assert GraftConfig(kv_lora_rank=16, qk_rope_head_dim=8).calibration_shrinkage == 0.5
    model = _model()
    common = {"kv_lora_rank": 24, "qk_rope_head_dim": 8, "objective": "attention", "rope_selection": "norm"}
    default = graft_mla(model, GraftConfig(**common), CALIB, progress=False).eval()
    half = graft_mla(model, GraftConfig(calibration_shrinkage=0.5, **common), CALIB, progress=False).eval()
    none = graft_mla(model, GraftConfig(calibration_shrinkage=0.0, **common), CALIB, progress=False).eval()
    with torch.no_grad():
        torch.testing.assert_close(default(IDS), half(IDS))
        assert (default(IDS) - none(IDS)).abs().max() > 1e-4


def test_partial_shrinkage_lies_between():
    model = _model()
    common = {"kv_lora_rank": 24, "qk_rope_head_dim": 8, "objective": "attention", "rope_selection": "stride"}
    outs = [graft_mla(model, GraftConfig(calibration_shrinkage=s, **common), CALIB, progress=False).eval() for s in (0.0, 0.3)]
    with torch.no_grad():
        ref = model(IDS)
        errs = [float((m(IDS) - ref).abs().max()) for m in outs]
    assert all(math.isfinite(e) for e in errs) and errs[0] != errs[1]


def test_clean_manual_and_spread_chunks():
    raw = "Title\r\n\r\n\r\n\r\n    indented line   \n        code\n"
    assert ood.clean_manual(raw) == "Title\n\nindented line\n    code"
    ids = np.arange(100)
    picked = ood.spread_chunks(ids, 30, 10)
    assert picked.tolist()[:10] == list(range(10)) and picked.tolist()[-10:] == list(range(90, 100))
    with pytest.raises(ood.OODError):
        ood.spread_chunks(ids, 200, 10)


def test_build_ood_eval_from_a_local_copy(tmp_path, monkeypatch):
    """The builder reads the manual (here a stand-in .txt.gz), tokenises it with the model's tokenizer and
    writes evenly spread chunks that the model's perplexity reads."""
    from kvgraft.reference import resolve_model

    src = tmp_path / "manual.txt.gz"
    with gzip.open(src, "wt", encoding="utf-8") as f:
        f.write("\n".join(f"    Section {i}: the apt-get command installs packages; dpkg -l lists them." for i in range(400)))
    monkeypatch.setattr(ood, "OOD_TEXT", src)
    out = tmp_path / "ood.npy"
    rec = ood.build_ood_eval(resolve_model(None), out, tokens=1024, chunk=256)
    arr = np.load(out)
    assert arr.size == rec["tokens_written"] == 1024 and rec["text_tokens"] > 1024
    assert arr.dtype == np.uint16 and int(arr.max()) < 8192


def test_convert_layer_on_an_explicit_device_matches_the_default():
    """``convert_layer(device=...)`` (what graft_mla uses to run the fp64 math on a CUDA model's GPU) gives
    the same weights as the default path; checked here with the CPU as the explicit device."""
    from kvgraft.graft.mla_math import GQAWeights, LayerSpec, convert_layer

    gen = torch.Generator().manual_seed(3)
    h, H, K, d = 32, 4, 2, 8
    w = GQAWeights(*(torch.randn(s, generator=gen) for s in ((H * d, h), (K * d, h), (K * d, h), (h, H * d))))
    a = torch.randn(h, h, dtype=torch.float64, generator=gen)
    spec = LayerSpec(
        num_heads=H, num_kv_heads=K, head_dim=d, kv_lora_rank=12, d_rope=4, objective="attention", rope_selection="norm"
    )
    kw = {
        "C": a @ a.T / h,
        "rope_expectation": torch.tensor([[0.9, 0.1], [0.5, 0.2], [0.2, 0.0], [0.1, 0.0]], dtype=torch.float64),
    }
    x, y = convert_layer(w, spec, **kw), convert_layer(w, spec, device="cpu", **kw)
    assert x.rope_freq_index == y.rope_freq_index
    for name in ("q_proj", "kv_a_proj", "kv_b_proj", "o_proj"):
        torch.testing.assert_close(getattr(x, name), getattr(y, name))


def test_prefix_rope_selection_keeps_the_fastest_frequencies():
    model = _model()
    new = graft_mla(model, GraftConfig(kv_lora_rank=20, qk_rope_head_dim=12, rope_selection="prefix"), CALIB, progress=False)
    assert new.config.rope_freq_index == ((0, 1, 2, 3, 4, 5),) * 2
    with pytest.raises(ValueError, match="prefix"):
        graft_mla(model, GraftConfig(kv_lora_rank=8, qk_rope_head_dim=20, rope_selection="prefix"), CALIB, progress=False)
