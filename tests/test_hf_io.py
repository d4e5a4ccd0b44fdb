"""kvgraft.hf input/output: every bad checkpoint gives a typed error naming the file and the value;
sharded checkpoints load; saves are atomic and never clobber; config.json mapping details."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch
from safetensors.torch import load_file, save_file

import kvgraft.hf.save as save_module
from kvgraft.errors import CheckpointError, KvgraftError, UnsupportedModelError
from kvgraft.hf import (
    SUPPORTED_MODEL_TYPES,
    hf_config_from_model,
    load_config,
    load_pretrained,
    load_tokenizer_dir,
    model_config_from_hf,
    save_pretrained,
)
from kvgraft.model import ModelConfig, Transformer

CFG = ModelConfig(
    vocab_size=50, hidden_size=16, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=32, bos_token_id=1, eos_token_id=2
)
HF_BASE = dict(
    model_type="llama",
    vocab_size=50,
    hidden_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=32,
)


def tiny_model(cfg: ModelConfig = CFG) -> Transformer:
    model = Transformer(cfg)
    model.init_weights(seed=0)
    return model.eval()


@pytest.fixture
def ckpt(tmp_path):
    return save_pretrained(tiny_model(), tmp_path / "ckpt")


def edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def edit_weights(path, edit):
    state = load_file(path / "model.safetensors")
    edit(state)
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})


def same_weights(a: Transformer, b: Transformer) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# ---- directory and config.json ------------------------------------------------------------------
def test_loads_what_it_saved(ckpt):
    model = load_pretrained(ckpt)
    assert model.config == CFG and same_weights(model, tiny_model())
    assert not model.training


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="nowhere.*does not exist"):
        load_pretrained(tmp_path / "nowhere")


def test_directory_without_config(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"empty has no config\.json"):
        load_pretrained(tmp_path / "empty")


def test_invalid_json(ckpt):
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config\.json is not valid JSON"):
        load_config(ckpt)


def test_unsupported_model_type(ckpt):
    edit_config(ckpt, model_type="gpt2")
    with pytest.raises(UnsupportedModelError) as err:
        load_pretrained(ckpt)
    message = str(err.value)
    assert "config.json" in message and "'gpt2'" in message
    assert all(name in message for name in ("llama", "mistral", "qwen2", "qwen3"))


@pytest.mark.parametrize("rope_type", ["longrope", "proportional"])
def test_unknown_rope_type(ckpt, rope_type):
    edit_config(ckpt, rope_parameters={"rope_type": rope_type, "rope_theta": 10000.0, "factor": 2.0})
    with pytest.raises(UnsupportedModelError) as err:
        load_pretrained(ckpt)
    message = str(err.value)
    assert "config.json" in message and repr(rope_type) in message
    assert all(kind in message for kind in ("default", "linear", "dynamic", "llama3", "yarn"))


# ---- weights --------------------------------------------------------------------------------------
def test_truncated_safetensors(ckpt):
    weights = ckpt / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(CheckpointError, match=r"model\.safetensors is not a valid safetensors file"):
        load_pretrained(ckpt)


def test_wrong_shape(ckpt):
    key = "model.layers.1.self_attn.k_proj.weight"
    edit_weights(ckpt, lambda s: s.update({key: torch.zeros(4, 16)}))
    with pytest.raises(CheckpointError) as err:
        load_pretrained(ckpt)
    assert f"{key}: expected (8, 16), found (4, 16)" in str(err.value)
    assert "model.safetensors" in str(err.value)


def test_missing_tensor(ckpt):
    edit_weights(ckpt, lambda s: s.pop("model.layers.0.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensors \['model\.layers\.0\.mlp\.up_proj\.weight'\]"):
        load_pretrained(ckpt)


def test_unexpected_tensor(ckpt):
    edit_weights(ckpt, lambda s: s.update({"model.layers.0.extra.weight": torch.zeros(3)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensors \['model\.layers\.0\.extra\.weight'\]"):
        load_pretrained(ckpt)


def test_tied_checkpoint_with_lm_head(tmp_path):
    tied = CFG.replace(tie_word_embeddings=True)
    path = save_pretrained(tiny_model(tied), tmp_path / "tied")
    assert "lm_head.weight" not in load_file(path / "model.safetensors")
    edit_weights(path, lambda s: s.update({"lm_head.weight": s["model.embed_tokens.weight"].clone()}))
    model = load_pretrained(path)  # an lm_head equal to the embedding is accepted
    assert model.lm_head.weight is model.embed_tokens.weight
    edit_weights(path, lambda s: s.update({"lm_head.weight": s["lm_head.weight"] + 1}))
    with pytest.raises(CheckpointError, match="lm_head.weight differs from model.embed_tokens.weight"):
        load_pretrained(path)


def write_shards(path):
    state = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    names = sorted(state)
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        shard = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({k: state[k] for k in part}, path / shard, metadata={"format": "pt"})
        weight_map |= {k: shard for k in part}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_sharded_checkpoint_loads(ckpt):
    write_shards(ckpt)
    assert same_weights(load_pretrained(ckpt), tiny_model())


def test_sharded_checkpoint_missing_shard(ckpt):
    write_shards(ckpt)
    (ckpt / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"shard model-00002-of-00002\.safetensors .*index\.json is missing"):
        load_pretrained(ckpt)


class _Trap:
    """Unpickling this creates a marker directory: proof that a file was unpickled."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def test_pickle_weights_refused(ckpt):
    (ckpt / "model.safetensors").unlink()
    marker = ckpt / "UNPICKLED"
    (ckpt / "pytorch_model.bin").write_bytes(pickle.dumps(_Trap(str(marker))))
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin.*never unpickles.*safetensors"):
        load_pretrained(ckpt)
    assert not marker.exists()


def test_no_weights(ckpt):
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"has no model\.safetensors"):
        load_pretrained(ckpt)


# ---- saving ---------------------------------------------------------------------------------------
def test_save_refuses_to_overwrite(ckpt):
    before = (ckpt / "model.safetensors").read_bytes()
    other = tiny_model(CFG.replace(rms_norm_eps=1e-5))
    with pytest.raises(FileExistsError, match="ckpt already exists.*overwrite=True") as err:
        save_pretrained(other, ckpt)
    assert isinstance(err.value, KvgraftError)
    assert (ckpt / "model.safetensors").read_bytes() == before
    save_pretrained(other, ckpt, overwrite=True)
    assert load_config(ckpt).rms_norm_eps == 1e-5


def test_interrupted_save_leaves_nothing(tmp_path, monkeypatch):
    def crash(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"partial")
        raise RuntimeError("disk full")

    monkeypatch.setattr(save_module, "save_file", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        save_pretrained(tiny_model(), tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_save_files_tokenizer_and_extras(ckpt, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    assert load_tokenizer_dir(ckpt) is None
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1, "b": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    tok.save(str(tok_dir / "tokenizer.json"))
    out = save_pretrained(tiny_model(), tmp_path / "out", tokenizer_dir=tok_dir, extra_files={"README.md": "hi\n"})
    assert (out / "README.md").read_text() == "hi\n"
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2
    assert load_tokenizer_dir(out)("a b")["input_ids"] == [1, 2]
    with pytest.raises(CheckpointError, match="has none of tokenizer.json"):
        save_pretrained(tiny_model(), tmp_path / "out2", tokenizer_dir=tmp_path / "nothing")


def test_save_refuses_unrepresentable_model_type(tmp_path):
    with pytest.raises(UnsupportedModelError, match="'qwen2' cannot express.*q/k/v biases"):
        save_pretrained(tiny_model(), tmp_path / "out", model_type="qwen2")
    with pytest.raises(UnsupportedModelError, match="'gpt2' is not supported"):
        hf_config_from_model(CFG, "gpt2")
    assert not (tmp_path / "out").exists()


# ---- config.json mapping --------------------------------------------------------------------------
def test_supported_model_types():
    assert SUPPORTED_MODEL_TYPES == ("llama", "mistral", "qwen2", "qwen3")


def test_old_rope_scaling_form_and_type_alias():
    cfg = model_config_from_hf(
        {**HF_BASE, "rope_theta": 500000.0, "max_position_embeddings": 128, "rope_scaling": {"type": "yarn", "factor": 4.0}},
        "c.json",
    )
    assert cfg.rope.rope_type == "yarn" and cfg.rope.theta == 500000.0 and cfg.rope.factor == 4.0
    assert cfg.rope.original_max_position_embeddings == 128  # transformers' default


@pytest.mark.parametrize("model_type", SUPPORTED_MODEL_TYPES)
def test_config_round_trip(model_type):
    cfg = model_config_from_hf(
        {**HF_BASE, "model_type": model_type, "eos_token_id": [7, 8], "head_dim": 8, "sliding_window": None}, "c.json"
    )
    assert cfg.eos_token_id == 7
    assert model_config_from_hf(hf_config_from_model(cfg, model_type), "again") == cfg


def test_family_defaults():
    qwen3 = model_config_from_hf({**HF_BASE, "model_type": "qwen3"}, "c.json")
    assert qwen3.head_dim == 128 and qwen3.qk_norm and not qwen3.qkv_bias
    qwen2 = model_config_from_hf({**HF_BASE, "model_type": "qwen2"}, "c.json")
    assert qwen2.head_dim == 4 and qwen2.qkv_bias and not qwen2.o_bias and qwen2.sliding_window is None
    mistral = model_config_from_hf({**HF_BASE, "model_type": "mistral"}, "c.json")
    assert mistral.sliding_window == 4096 and set(mistral.layer_types) == {"sliding_attention"}
    llama = model_config_from_hf({**HF_BASE, "attention_bias": True, "num_key_value_heads": None}, "c.json")
    assert llama.qkv_bias and llama.o_bias and llama.num_kv_heads == 4


@pytest.mark.parametrize(
    "change, match",
    [
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported; expected 'silu'"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5 is not supported"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "short_factor": [1.0]}}, "short_factor"),
    ],
)
def test_unsupported_options(change, match):
    with pytest.raises(UnsupportedModelError, match=f"c.json: .*{match}"):
        model_config_from_hf({**HF_BASE, **change}, "c.json")


def test_inconsistent_sliding_layers():
    d = {**HF_BASE, "model_type": "qwen2", "layer_types": ["full_attention", "sliding_attention"]}
    with pytest.raises(CheckpointError, match="c.json: layer_types lists sliding_attention"):
        model_config_from_hf(d, "c.json")


def test_missing_and_invalid_fields():
    with pytest.raises(CheckpointError, match=r"c.json: missing required field\(s\) \['hidden_size'\]"):
        model_config_from_hf({k: v for k, v in HF_BASE.items() if k != "hidden_size"}, "c.json")
    with pytest.raises(CheckpointError, match="c.json: invalid model config: num_heads"):
        model_config_from_hf({**HF_BASE, "num_key_value_heads": 3}, "c.json")


def test_config_replace_rederives_defaults():
    cfg = ModelConfig(vocab_size=50, hidden_size=16, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=32)
    deeper = cfg.replace(num_layers=4)
    assert deeper.layer_types == ("full_attention",) * 4 and deeper.kv_slots == (0, 1, 2, 3)
    assert cfg.replace(hidden_size=32).head_dim == 8
    explicit = ModelConfig(
        vocab_size=50, hidden_size=16, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=32, head_dim=8
    )
    assert explicit.replace(hidden_size=32).head_dim == 8  # given fields stay as given
    with pytest.raises(ValueError, match="kv_slots has 2 entries"):
        ModelConfig(
            vocab_size=50, hidden_size=16, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=32, kv_slots=(0, 0)
        ).replace(num_layers=3)
