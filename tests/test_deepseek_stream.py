"""The streamed stock DeepSeek-V3 export (``kvgraft.hf.deepseek.stream``) writes what the whole-model export
(``export_deepseek_v3``) writes for the same converted model: every file byte for byte (tensors, config.json,
the README card with its measured figures) and the same report, figures equal (not merely close), on tiny
random Llama / Qwen2 (attention biases: the engine-safe folds, the low-rank query path) / Qwen3 (q/k norms
linearised) / Mistral (a sliding window: the within-window figure) checkpoints for both constructions, and
on the reference model; its transformers check refuses a checkpoint transformers would not load cleanly."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch
import transformers

import kvgraft.hf.deepseek.stream as stream
from kvgraft.errors import CheckpointError
from kvgraft.graft.calibration import calibration_ids
from kvgraft.graft.convert import execute
from kvgraft.graft.options import ConvertOptions
from kvgraft.graft.plan import plan_conversion
from kvgraft.hf import load_pretrained
from kvgraft.hf.deepseek import ExportOptions, export_deepseek_v3, load_stock
from kvgraft.hf.deepseek.stream import export_deepseek_v3_streamed
from kvgraft.hf.load import read_state

TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
    head_dim=16,
)
FAMILIES = {"llama": dict(), "mistral": dict(sliding_window=12), "qwen2": dict(), "qwen3": dict()}
OPTIONS = dict(progress=False, calibration_tokens=1024, calibration_seq_len=32)


def _converted(tmp_path, family: str, target: str):
    """A tiny random ``family`` checkpoint converted (kvgraft format, grafted for a ``target`` stock export);
    (converted directory, its calibration ids)."""
    cfg = transformers.AutoConfig.for_model(family, **(TINY | FAMILIES[family]))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # non-trivial biases and norm weights
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.3)
            elif "norm" in name:
                p.uniform_(0.6, 1.4)
    src = tmp_path / "src"
    model.save_pretrained(src)
    (src / "eval").mkdir()
    np.save(src / "eval" / "calibration.npy", np.random.default_rng(0).integers(0, 96, 4096).astype(np.uint16))
    # without the graft's own latent norm (--no-latent-norm): the export's fitted / padded / scaled latent norms
    # are what these tests compare between the streamed and the whole-model export
    plan = plan_conversion(
        src, tmp_path / "conv", ConvertOptions(output_format="both", stock_construction=target, latent_norm=False, **OPTIONS)
    )
    execute(plan)
    assert plan.calibration is not None
    return tmp_path / "conv", calibration_ids(plan.source, plan.calibration, 96)


def _assert_same_exports(a, b, report_a, report_b):
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir())
    for name in files:
        x, y = (a / name).read_bytes(), (b / name).read_bytes()
        if name == "README.md":  # the card names its own path
            x, y = x.replace(bytes(a), b""), y.replace(bytes(b), b"")
        assert x == y, name
    da, db = report_a.to_dict(), report_b.to_dict()
    assert da.pop("path") == str(a) and db.pop("path") == str(b)
    assert da == db  # every figure equal: the same logits, reduced in the same order


def _both(conv, calib, tmp_path, target):
    model = load_pretrained(conv, dtype=torch.float32, check_weights=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        whole = export_deepseek_v3(model, tmp_path / "whole", ExportOptions(target=target), calibration=calib)
        streamed = export_deepseek_v3_streamed(
            conv, model.config, tmp_path / "streamed", ExportOptions(target=target), calibration=calib
        )
    return model, whole, streamed


@pytest.mark.parametrize("target", ["engines", "transformers"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_streamed_export_equals_whole_model_export(tmp_path, family, target):
    conv, calib = _converted(tmp_path, family, target)
    _, whole, streamed = _both(conv, calib, tmp_path, target)
    _assert_same_exports(tmp_path / "whole", tmp_path / "streamed", whole, streamed)
    assert streamed.max_abs_logit_diff is not None and streamed.perplexity is not None
    if family == "mistral":
        assert streamed.max_abs_logit_diff_within_window is not None
    if family == "qwen2" and target == "engines":  # the biases were folded with calibration statistics
        assert any("attention biases" in a for a in streamed.approximations)
    if target == "transformers" and family != "mistral":  # exact constructions: the check measures fp noise
        assert streamed.max_abs_logit_diff < 1e-4


def test_streamed_export_without_calibration_and_in_shards(tmp_path, monkeypatch):
    """No calibration ("fit" falls back to "scale", measured on random ids), shards of one layer (the floor
    lowered): the same tensors as the whole-model export's one file, and the same report."""
    conv, _ = _converted(tmp_path, "llama", "engines")
    monkeypatch.setattr(stream, "SHARD_FLOOR", 1)
    model, whole, streamed = _both(conv, None, tmp_path, "engines")
    assert (tmp_path / "streamed" / "model.safetensors.index.json").is_file()
    sa, sb = read_state(tmp_path / "whole"), read_state(tmp_path / "streamed")
    assert sorted(sa) == sorted(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)
    ids = torch.arange(20).view(2, 10)
    with torch.no_grad():  # the sharded export loads cleanly in transformers and computes the one file's logits
        assert torch.equal(load_stock(tmp_path / "streamed")(ids).logits, load_stock(tmp_path / "whole")(ids).logits)
    da, db = whole.to_dict(), streamed.to_dict()
    da.pop("path"), db.pop("path")
    assert json.dumps(da) == json.dumps(db)  # as text: the latent cvs are NaN without calibration
    assert streamed.latent_norm == "scale" and "random ids" in str(streamed.measured_on)


def test_streamed_check_refuses_what_transformers_would_not_load(tmp_path, monkeypatch):
    conv, calib = _converted(tmp_path, "llama", "engines")
    layer_tensors = stream.layer_tensors

    def drop_one(*args, **kwargs):
        out = layer_tensors(*args, **kwargs)
        out.pop(next(k for k in out if k.endswith("o_proj.weight")))
        return out

    monkeypatch.setattr(stream, "layer_tensors", drop_one)
    model = load_pretrained(conv, dtype=torch.float32, check_weights=False)
    with pytest.raises(CheckpointError, match=r"does not load cleanly in transformers: \{'missing_keys'"):
        export_deepseek_v3_streamed(conv, model.config, tmp_path / "bad", calibration=calib)
    assert not (tmp_path / "bad").exists()


def test_streamed_export_refuses_bad_arguments_before_work(tmp_path):
    conv, calib = _converted(tmp_path, "llama", "engines")
    cfg = load_pretrained(conv, dtype=torch.float32, check_weights=False).config
    with pytest.raises(ValueError, match="batch_size"):
        export_deepseek_v3_streamed(conv, cfg, tmp_path / "x", calibration=calib, batch_size=0)
    with pytest.raises(ValueError, match="target 'vllm'"):
        export_deepseek_v3_streamed(conv, cfg, tmp_path / "x", ExportOptions(target="vllm"), calibration=calib)
    with pytest.raises(ValueError, match="latent_norm 'pad'"):
        export_deepseek_v3_streamed(conv, cfg, tmp_path / "x", ExportOptions(latent_norm="pad"), calibration=calib)
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
@pytest.mark.parametrize("target", ["engines", "transformers"])
def test_streamed_export_equals_whole_model_export_on_the_reference(tmp_path, target):
    from kvgraft.reference import resolve_model

    src = resolve_model("kvgraft-llama-8m")
    plan = plan_conversion(
        src,
        tmp_path / "conv",
        ConvertOptions(output_format="both", stock_construction=target, progress=False, calibration_tokens=4096),
    )
    execute(plan)
    assert plan.calibration is not None
    calib = calibration_ids(plan.source, plan.calibration, plan.source_config.vocab_size)
    _, whole, streamed = _both(tmp_path / "conv", calib, tmp_path, target)
    _assert_same_exports(tmp_path / "whole", tmp_path / "streamed", whole, streamed)
