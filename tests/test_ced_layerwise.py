"""``kvgraft convert --to ced`` layer by layer (``kvgraft.graft.ced_layerwise``) writes what the whole-model
executor writes: every tensor equal bit for bit, the same config.json, and the same conversion.json (the share
graft's report in it) apart from timings and the output path, on tiny random checkpoints of each family the
share graft takes (Llama, Qwen2 with biases, Qwen3 with q/k norms, Mistral with a sliding window), default
and explicit kv_source layers, pooled sources (compress_rate > 1), the walks that change the MLA stream, an
all-MLA source, and the 8M reference; and a resumed --to ced conversion equals an uninterrupted one."""

from __future__ import annotations

import json

import pytest
import torch
from test_convert_layerwise import _assert_same, _checkpoint  # tiny HF checkpoints, the executors' comparison
from test_convert_resume import Interrupt, _fail_at

from kvgraft.graft.convert import execute
from kvgraft.graft.options import ConvertOptions
from kvgraft.graft.plan import plan_conversion
from kvgraft.graft.resume import STATE, staging_path
from kvgraft.hf import load_pretrained
from kvgraft.reference import resolve_model

OPTIONS = dict(progress=False, calibration_tokens=1024, calibration_seq_len=32, to="ced", sliding_window=8)


def _both(tmp_path, path, **options):
    """Convert ``path`` --to ced with each executor; (whole record, layerwise record, whole dir, layerwise dir)."""
    options = OPTIONS | options
    whole = execute(plan_conversion(path, tmp_path / "whole", ConvertOptions(**options)), executor="whole").to_dict()
    layer = execute(plan_conversion(path, tmp_path / "layer", ConvertOptions(**options))).to_dict()  # the default executor
    return whole, layer, tmp_path / "whole", tmp_path / "layer"


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_ced_layerwise_equals_whole_model_on_each_family(tmp_path, family):
    whole, layer, a, b = _both(tmp_path, _checkpoint(tmp_path, family, num_hidden_layers=6))
    assert whole["share_graft"]["kv_source_layers"] == [2, 3] and set(whole["share_graft"]["readers"]) == {4, 5}
    assert whole["calibration_tail"] is not None
    _assert_same(whole, layer, a, b)
    ced = load_pretrained(b)
    assert ced.config.is_ced
    with torch.no_grad():
        assert torch.isfinite(ced(torch.arange(20).view(2, 10))).all()


@pytest.mark.parametrize(
    "options",
    [
        dict(kv_source_layers=(1, 3), compress_rate=2),  # two sources, each read by the layers above, pooled
        dict(kv_source_layers=(0, 2, 4), compress_rate=4),  # every source reads its own pooled latent too
        dict(kv_source_layers=(1, 3), layerwise=False),  # the MLA graft's stream is the original's: its own
        dict(kv_source_layers=(2,), rope_selection="stride"),  # no first pass; layers 0-1 window only
    ],
    ids=["pooled-2", "pooled-4-every-source", "not-layerwise", "stride"],
)
def test_ced_layerwise_equals_whole_model_for_each_walk(tmp_path, options):
    whole, layer, a, b = _both(tmp_path, _checkpoint(tmp_path, "qwen2", num_hidden_layers=6), **options)
    assert whole["share_graft"]["readers"]
    _assert_same(whole, layer, a, b)


def test_ced_layerwise_equals_whole_model_from_an_all_mla_source(tmp_path):
    """An MLA graft with one RoPE layout is used as it is: the walk runs its own MLA stream."""
    src = _checkpoint(tmp_path, "llama", num_hidden_layers=5)
    mla = tmp_path / "mla"
    execute(
        plan_conversion(
            src, mla, ConvertOptions(progress=False, calibration_tokens=1024, calibration_seq_len=32, rope_selection="stride")
        )
    )
    (mla / "eval").mkdir(exist_ok=True)
    (mla / "eval" / "calibration.npy").write_bytes((src / "eval" / "calibration.npy").read_bytes())
    whole, layer, a, b = _both(tmp_path, mla, kv_source_layers=(1, 3), compress_rate=2)
    assert whole["graft"] is None and set(whole["share_graft"]["readers"]) == {1, 2, 3, 4}
    _assert_same(whole, layer, a, b)


def test_default_executor_for_ced_reads_no_whole_model(tmp_path, monkeypatch):
    import kvgraft.graft.convert as conv

    def tripwire(*args, **kwargs):
        raise AssertionError("the whole model was loaded")

    monkeypatch.setattr(conv, "load_source", tripwire)
    record = execute(plan_conversion(_checkpoint(tmp_path, "llama"), tmp_path / "ced", ConvertOptions(**OPTIONS))).to_dict()
    assert record["to"] == "ced" and (tmp_path / "ced" / "model.safetensors").is_file()


@pytest.mark.slow
def test_ced_layerwise_equals_whole_model_on_the_reference(tmp_path):
    """kvgraft-llama-8m (8 layers: kv_source layers 1, 3, 4), its shipped calibration, 4,096 tokens."""
    path = resolve_model("kvgraft-llama-8m")
    whole, layer, a, b = _both(tmp_path, path, calibration_tokens=4096, calibration_seq_len=512, sliding_window=64)
    assert set(whole["share_graft"]["readers"]) == {2, 5, 6, 7}
    _assert_same(whole, layer, a, b)


def _interrupted_then_resumed(tmp_path, monkeypatch, path, k: int, **options):
    """(uninterrupted record, resumed record, uninterrupted dir, resumed dir); the --to ced run fails after layer k."""
    options = OPTIONS | options
    reference = execute(plan_conversion(path, tmp_path / "reference", ConvertOptions(**options))).to_dict()
    out = tmp_path / "out"
    first_pass = options.get("rope_selection", "auto") in ("auto", "shared")  # the shared layout reads every layer first
    with monkeypatch.context() as m:
        _fail_at(m, k + 1, 2 if first_pass else 1)
        with pytest.raises(Interrupt):
            execute(plan_conversion(path, out, ConvertOptions(**options)))
    assert json.loads((staging_path(out) / STATE).read_text())["next_layer"] == k + 1
    read = _fail_at(monkeypatch, -1)  # counts only
    resumed = execute(plan_conversion(path, out, ConvertOptions(resume=True, **options))).to_dict()
    assert min(read) == k + 1, "a finished layer was read again"
    assert not staging_path(out).exists() and not list(out.glob("state*"))
    return reference, resumed, tmp_path / "reference", out


@pytest.mark.parametrize(
    ("k", "options"),
    [
        (1, dict()),  # before the first kv_source layer (2)
        (3, dict()),  # after the pivot (3), before its readers: its latents in the checkpoint
        (2, dict(kv_source_layers=(1, 3), compress_rate=2, layerwise=False)),  # the walk's own stream, pooled
        (4, dict(kv_source_layers=(0, 2, 4), compress_rate=4, rope_selection="stride")),
    ],
    ids=["before-sources", "after-pivot", "own-stream-pooled", "stride-pooled"],
)
def test_resumed_ced_conversion_is_bit_identical_to_an_uninterrupted_one(tmp_path, monkeypatch, k, options):
    path = _checkpoint(tmp_path, "qwen3", num_hidden_layers=6)
    reference, resumed, a, b = _interrupted_then_resumed(tmp_path, monkeypatch, path, k, **options)
    _assert_same(reference, resumed, a, b)
    assert resumed["share_graft"]["readers"] and resumed["calibration_tail"] is not None
