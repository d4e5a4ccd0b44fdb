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
from kvgraft.graft.options import ConvertOptions
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
    whole = execute(plan_conversion(path, tmp_path / "whole", ConvertOptions(**options)), executor="whole").to_dict()
    layer = execute(plan_conversion(path, tmp_path / "layer", ConvertOptions(**options)), executor="layerwise").to_dict()
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


def test_default_executor_is_layerwise_in_every_format_and_target(tmp_path, monkeypatch):
    import kvgraft.graft.convert as conv

    path = _checkpoint(tmp_path, "llama")

    def tripwire(*args, **kwargs):
        raise AssertionError("the whole model was loaded")

    monkeypatch.setattr(conv, "load_source", tripwire)
    execute(plan_conversion(path, tmp_path / "default", ConvertOptions(progress=False, calibration_tokens=1024)))
    execute(
        plan_conversion(path, tmp_path / "stock", ConvertOptions(progress=False, calibration_tokens=1024, output_format="both"))
    )
    execute(
        plan_conversion(path, tmp_path / "ced", ConvertOptions(progress=False, calibration_tokens=1024, to="ced"))
    )  # tests/test_ced_layerwise.py
    assert (tmp_path / "ced" / "model.safetensors").is_file()
    with pytest.raises(ValueError, match="executor 'banana'"):
        execute(plan_conversion(path, tmp_path / "x", ConvertOptions(progress=False, calibration_tokens=1024)), executor="banana")


def _assert_same_files(a, b):
    """Every file under ``a`` is under ``b`` with the same bytes (conversion.json aside: timings and paths)."""
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    for rel in files:
        if rel.name != "conversion.json":
            text_a, text_b = (a / rel).read_bytes(), (b / rel).read_bytes()
            if rel.name == "README.md":  # the export's card names its own path
                text_a, text_b = text_a.replace(bytes(a), b""), text_b.replace(bytes(b), b"")
            assert text_a == text_b, rel


@pytest.mark.parametrize("family", list(FAMILIES))
def test_layerwise_stock_export_equals_whole_model_on_each_family(tmp_path, family):
    """--format deepseek_v3: the graft layer by layer, the export from the converted model read back; the
    same export (every file, byte for byte) and record as the whole-model executor's."""
    whole, layer, a, b = _both(tmp_path, _checkpoint(tmp_path, family), output_format="deepseek_v3")
    _assert_same_files(a, b)
    assert not (b / ".kvgraft").exists() and not (b / "model.safetensors").exists()
    assert _stock_stripped(whole) == _stock_stripped(layer) and layer["formats"] == ["deepseek_v3"]
    assert _stock_stripped(json.loads((b / "conversion.json").read_text())) == _stock_stripped(layer)


def _stock_stripped(record):
    """A record without timings, the plan (its output path) and the export's path."""
    out = {k: v for k, v in record.items() if k not in TIMINGS | {"plan"}}
    out["deepseek_v3"] = {k: v for k, v in record["deepseek_v3"].items() if k != "path"}
    return out


def test_layerwise_both_formats_equal_whole_model(tmp_path):
    whole, layer, a, b = _both(tmp_path, _checkpoint(tmp_path, "qwen2"), output_format="both", stock_construction="transformers")
    _assert_same_files(a, b)
    sa, sb = read_state(a), read_state(b)
    assert sorted(sa) == sorted(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert _stock_stripped(whole) == _stock_stripped(layer) and layer["formats"] == ["kvgraft", "deepseek_v3"]


def test_layerwise_stock_export_refuses_mlp_biases_before_work(tmp_path):
    from safetensors.torch import load_file, save_file

    from kvgraft.errors import UnsupportedModelError

    path = _checkpoint(tmp_path, "llama", mlp_bias=True)
    state = load_file(str(path / "model.safetensors"))
    state["model.layers.1.mlp.up_proj.bias"][3] = 0.5
    for name in state:
        if name.endswith("bias") and "mlp" in name and "layers.1.mlp.up_proj" not in name:
            state[name].zero_()
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    for executor in ("whole", "layerwise"):
        plan = plan_conversion(
            path, tmp_path / executor, ConvertOptions(progress=False, calibration_tokens=1024, output_format="deepseek_v3")
        )
        with pytest.raises(UnsupportedModelError, match=r"the MLP of layers \[1\] has non-zero biases"):
            execute(plan, executor=executor)
        assert not (tmp_path / executor).exists()


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
    plan = plan_conversion(path, tmp_path / "out", ConvertOptions(progress=False, calibration_tokens=1024))
    with pytest.raises(CheckpointError, match="model.layers.2.mlp.up_proj.weight .* holds 0 NaN and 1 Inf"):
        execute(plan)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_all_finite_agrees_with_isfinite_on_every_16_bit_value(dtype):
    """The converter's bit-level finiteness check (it reads every source tensor before any work) against
    torch.isfinite, value by value over all 65,536 bit patterns, and on fp32 around its limits."""
    from kvgraft.hf.load import all_finite

    values = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    ok = torch.isfinite(values)
    got = torch.tensor([all_finite(v.reshape(1)) for v in values])
    assert torch.equal(got, ok) and not all_finite(values) and all_finite(values[ok])
    big = torch.tensor([torch.finfo(torch.float32).max, -torch.finfo(torch.float32).max, 1e-45])
    assert all_finite(big) and not all_finite(torch.cat([big, torch.tensor([float("nan")])]))
    assert all_finite(values[ok].reshape(-1, 2)[:, 0])  # a strided view


@pytest.mark.parametrize("layerwise", [True, False])
def test_tail_states_read_off_the_stream_are_the_ones_run_again(tmp_path, monkeypatch, layerwise):
    """The calibration tail's states of the stack the stream runs (converted when layer-wise, else original)
    are read off the stream below the last converted layer: the tail is run only where the stream is not,
    and the record (its tail figures) is the same bit for bit as running every tail state again."""
    import kvgraft.graft.layerwise as lw

    path = _checkpoint(tmp_path, "llama")
    calls = []
    run_block = lw.run_block
    monkeypatch.setattr(lw, "run_block", lambda *a, **k: calls.append(1) or run_block(*a, **k))
    options = dict(progress=False, calibration_tokens=1024, calibration_seq_len=32, layerwise=layerwise)
    read = execute(plan_conversion(path, tmp_path / "read", ConvertOptions(**options))).to_dict()
    assert len(calls) == 3 + 1  # one stack every layer, the other only at the last layer (2: not propagated)
    monkeypatch.setattr(lw, "REUSE_TAIL", False)
    again = execute(plan_conversion(path, tmp_path / "again", ConvertOptions(**options))).to_dict()
    assert len(calls) == 4 + 6
    assert read["calibration_tail"] == again["calibration_tail"]
    sa, sb = read_state(tmp_path / "read"), read_state(tmp_path / "again")
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_shard_files_are_save_files_byte_for_byte(tmp_path):
    """ShardWriter's own safetensors writer (no in-memory copy of the shard) writes what safetensors'
    save_file writes, byte for byte: every dtype, empty and 0-d tensors, with and without metadata."""
    from safetensors.torch import load_file, save_file

    from kvgraft.hf.shards import _ST_DTYPES, write_safetensors

    g = torch.Generator().manual_seed(0)
    tensors = {f"t{(7 * i) % 5}.{i}": (torch.randn(3, 4, generator=g) * 10).to(dt) for i, dt in enumerate(_ST_DTYPES)}
    tensors |= {"empty": torch.zeros(0, 3), "scalar": torch.tensor(2.5), "model.layers.0.w": torch.randn(64, 32, generator=g)}
    for metadata in ({"format": "pt"}, None):
        save_file(tensors, str(tmp_path / "a.safetensors"), metadata=metadata)
        write_safetensors(tmp_path / "b.safetensors", tensors, metadata)
        assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()
    back = load_file(str(tmp_path / "b.safetensors"))
    assert all(torch.equal(back[k], v) for k, v in tensors.items())
    with pytest.raises(ValueError, match="contiguous"):
        write_safetensors(tmp_path / "c.safetensors", {"x": torch.randn(4, 4).T})


def test_reader_casts_large_tensors_in_chunks_to_the_same_values(tmp_path, monkeypatch):
    """A cast tensor larger than CHUNK_BYTES is read a few rows at a time (pages unmapped after each chunk):
    the values are the whole read's, bit for bit, for bf16 and fp32 files and rows that do not divide."""
    import kvgraft.hf.shards as shards

    path = _checkpoint(tmp_path, "llama", max_shard_size="60KB", torch_dtype=torch.bfloat16)
    with shards.CheckpointReader(path) as reader:
        whole = {k: reader.get(k, dtype=torch.float64) for k in reader.keys()}
        monkeypatch.setattr(shards, "CHUNK_BYTES", 1000)  # 96 x 64 bf16 rows: 7 rows a chunk
        chunked = {k: reader.get(k, dtype=torch.float64) for k in reader.keys()}
        same = {k: reader.get(k) for k in reader.keys()}  # no cast: read whole, the file's dtype
    assert all(torch.equal(whole[k], chunked[k]) and chunked[k].dtype == torch.float64 for k in whole)
    assert all(torch.equal(same[k].double(), whole[k]) for k in whole)
    assert any(t.numel() * t.element_size() > 1000 and t.dim() == 2 for t in same.values())  # the chunked path ran
    assert {t.dtype for t in same.values()} == {torch.bfloat16}
