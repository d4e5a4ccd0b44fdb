"""The layer-by-layer executor of ``kvgraft convert`` (``kvgraft.graft.layerwise``) writes what the whole-model
executor writes: every tensor equal bit for bit, the same config.json, and the same conversion.json apart from
timings and the output path, on tiny random checkpoints of each family (Llama, Qwen2 with biases, Qwen3 with
q/k norms, Mistral with a sliding window) and on the options that change the walk up the layers."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers

from kvgraft.graft.convert import execute
from kvgraft.graft.plan import plan_conversion
from kvgraft.hf import load_pretrained
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
TIMINGS = {"seconds", "convert_seconds_per_million_params"}


def _checkpoint(tmp_path, family: str, max_shard_size: str | None = None, **extra):
    cfg = transformers.AutoConfig.for_model(family, **(TINY | FAMILIES[family] | extra))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # non-trivial biases and norm weights
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.3)
            elif "norm" in name:
                p.uniform_(0.6, 1.4)
    path = tmp_path / f"{family}-src"
    model.save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    (path / "eval").mkdir()
    np.save(path / "eval" / "calibration.npy", np.random.default_rng(0).integers(0, 96, 4096).astype(np.uint16))
    return path


def _both(tmp_path, path, **options):
    """Convert ``path`` with each executor; (whole record, layerwise record, whole dir, layerwise dir)."""
    options = dict(progress=False, calibration_tokens=1024, calibration_seq_len=32) | options
    whole = execute(plan_conversion(path, tmp_path / "whole", **options), executor="whole")
    layer = execute(plan_conversion(path, tmp_path / "layer", **options), executor="layerwise")
    return whole, layer, tmp_path / "whole", tmp_path / "layer"


def _assert_same(whole, layer, a, b):
    sa, sb = read_state(a), read_state(b)
    assert sorted(sa) == sorted(sb)
    for name in sa:
        assert sa[name].dtype == sb[name].dtype == torch.float32, name
        assert torch.equal(sa[name], sb[name]), name
    assert json.loads((a / "config.json").read_text()) == json.loads((b / "config.json").read_text())

    def strip(record):
        out = {k: v for k, v in record.items() if k not in TIMINGS}
        out["plan"] = {k: v for k, v in record["plan"].items() if k != "out"}
        return out

    assert strip(whole) == strip(layer)
    assert strip(json.loads((a / "conversion.json").read_text())) == strip(json.loads((b / "conversion.json").read_text()))
    assert set(whole["seconds"]) == set(layer["seconds"]) == {"load", "convert"}
    assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())


@pytest.mark.parametrize("family", list(FAMILIES))
def test_layerwise_equals_whole_model_on_each_family(tmp_path, family):
    whole, layer, a, b = _both(tmp_path, _checkpoint(tmp_path, family))
    assert whole["calibration_tail"] is not None
    _assert_same(whole, layer, a, b)
    with torch.no_grad():
        assert torch.isfinite(load_pretrained(b)(torch.arange(20).view(2, 10))).all()


@pytest.mark.parametrize(
    "options",
    [
        dict(layers=(0, 1)),  # progressive: the top layer copied, the walk stops below it but the tail runs on
        dict(layerwise=False),  # statistics on the original stack: both streams run
        dict(objective="weights"),  # no calibration, no tail
        dict(rope_selection="shared"),  # a first pass over the original stack for the shared layout
        dict(kv_lora_rank=64, qk_rope_head_dim=32, rope_selection="norm"),  # full budget
    ],
    ids=["layers", "not-layerwise", "weights", "shared", "full-budget"],
)
def test_layerwise_equals_whole_model_for_each_walk(tmp_path, options):
    whole, layer, a, b = _both(tmp_path, _checkpoint(tmp_path, "qwen2"), **options)
    _assert_same(whole, layer, a, b)


def test_layerwise_reads_sharded_tied_sources_and_writes_shards(tmp_path, monkeypatch):
    """A sharded source with tied embeddings; output shards of about one layer (the floor lowered) that
    load as the one-file output does."""
    import kvgraft.graft.layerwise as lw

    path = _checkpoint(tmp_path, "qwen3", max_shard_size="60KB", tie_word_embeddings=True)
    assert (path / "model.safetensors.index.json").is_file()
    monkeypatch.setattr(lw, "SHARD_FLOOR", 1)
    whole, layer, a, b = _both(tmp_path, path)
    assert (b / "model.safetensors.index.json").is_file() and not (a / "model.safetensors.index.json").is_file()
    sa, sb = read_state(a), read_state(b)
    assert "lm_head.weight" not in sb and sorted(sa) == sorted(sb)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    strip = TIMINGS | {"plan"}
    assert {k: v for k, v in whole.items() if k not in strip} == {k: v for k, v in layer.items() if k not in strip}
    ids = torch.arange(20).view(2, 10)
    with torch.no_grad():
        assert torch.equal(load_pretrained(a)(ids), load_pretrained(b)(ids))


def test_default_executor_is_layerwise_for_mla_in_kvgraft_format_only(tmp_path, monkeypatch):
    import kvgraft.graft.convert as conv

    path = _checkpoint(tmp_path, "llama")

    def tripwire(*args, **kwargs):
        raise AssertionError("the whole model was loaded")

    monkeypatch.setattr(conv, "load_source", tripwire)
    execute(plan_conversion(path, tmp_path / "default", progress=False, calibration_tokens=1024))
    with pytest.raises(AssertionError, match="whole model"):  # the stock export still loads the whole model
        execute(plan_conversion(path, tmp_path / "stock", progress=False, calibration_tokens=1024, output_format="both"))
    assert not (tmp_path / "stock").exists()
    with pytest.raises(ValueError, match="--format kvgraft only"):
        execute(
            plan_conversion(path, tmp_path / "stock", progress=False, calibration_tokens=1024, output_format="both"),
            executor="layerwise",
        )
    with pytest.raises(ValueError, match="executor 'banana'"):
        execute(plan_conversion(path, tmp_path / "x", progress=False, calibration_tokens=1024), executor="banana")


def test_reader_release_unmaps_and_reads_again(tmp_path):
    from kvgraft.hf.shards import CheckpointReader

    path = _checkpoint(tmp_path, "llama", max_shard_size="60KB")
    with CheckpointReader(path) as reader:
        first = {k: reader.get(k) for k in reader.keys()}
        reader.release()
        assert all(h is None for h in reader._handles)
        assert all(torch.equal(reader.get(k), t) for k, t in first.items())


def test_layerwise_refuses_non_finite_weights_before_writing(tmp_path):
    from safetensors.torch import load_file, save_file

    from kvgraft.errors import CheckpointError

    path = _checkpoint(tmp_path, "llama")
    state = load_file(str(path / "model.safetensors"))
    state["model.layers.2.mlp.up_proj.weight"][0, 0] = float("inf")
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    plan = plan_conversion(path, tmp_path / "out", progress=False, calibration_tokens=1024)
    with pytest.raises(CheckpointError, match="model.layers.2.mlp.up_proj.weight .* holds 0 NaN and 1 Inf"):
        execute(plan)
    assert not (tmp_path / "out").exists()
