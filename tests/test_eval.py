"""Tests for kvgraft.eval: perplexity formula and counting, KV bytes formula vs allocation, decode
speed bookkeeping, evaluate() reports and their text/JSON views (tiny random models, fast)."""

from __future__ import annotations

import json
import math
import warnings

import numpy as np
import pytest
import torch

from kvgraft.data import DOC_SEPARATOR
from kvgraft.eval import (
    EvalOptions,
    KVMemory,
    PerplexityResult,
    SpeedPoint,
    compare_table,
    decode_speed,
    evaluate,
    format_ppl,
    format_report,
    kv_memory,
    perplexity,
    text_to_tokens,
)
from kvgraft.model import ModelConfig, Transformer
from kvgraft.model.shapes import num_parameters

V = 64


def tiny_config(**changes) -> ModelConfig:
    base = dict(
        vocab_size=V,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    base.update(changes)
    return ModelConfig(**base)


def tiny_model(seed: int = 0, **changes) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(tiny_config(**changes))
    model.init_weights(seed)
    # larger weights than the init so the model is far from uniform and the checks have teeth
    with torch.no_grad():
        model.lm_head.weight.mul_(25.0)
    return model.eval()


def stream(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, V, size=n).astype(np.uint16)


# ------------------------------------------------------------------------------------ perplexity


def test_uniform_logits_give_vocab_size_perplexity():
    model = tiny_model()
    with torch.no_grad():
        model.lm_head.weight.zero_()
    res = perplexity(model, stream(200), seq_len=16, batch_size=3, progress=False)
    assert isinstance(res, PerplexityResult)
    assert res.loss == pytest.approx(math.log(V), abs=1e-6)
    assert res.ppl == pytest.approx(V, abs=1e-4)


def test_perplexity_matches_independent_cross_entropy():
    model = tiny_model(seed=1)
    seq_len = 16
    tokens = stream(3 * seq_len + 5, seed=1)  # 3 windows, the 4-token tail is ignored
    res = perplexity(model, tokens, seq_len=seq_len, batch_size=2, progress=False)

    nll, count = 0.0, 0
    with torch.no_grad():
        for w in range(3):
            x = torch.tensor(tokens[w * seq_len : w * seq_len + seq_len + 1].astype(np.int64))
            logp = torch.log_softmax(model(x[None, :-1])[0].double(), dim=-1)
            nll -= logp.gather(-1, x[1:, None]).sum().item()
            count += seq_len
    expected = nll / count
    assert res.num_windows == 3 and res.tokens_scored == count
    assert res.loss == pytest.approx(expected, rel=1e-5)
    assert res.ppl == pytest.approx(math.exp(expected), rel=1e-5)
    assert abs(res.loss - math.log(V)) > 0.05  # not trivially uniform
    # batching does not change the result; a .npy path works like the array
    assert perplexity(model, tokens, seq_len=seq_len, batch_size=8, progress=False).loss == pytest.approx(res.loss, rel=1e-6)


def test_perplexity_npy_path_and_default_seq_len(tmp_path):
    model = tiny_model()
    tokens = stream(64 * 2 + 1)
    np.save(tmp_path / "t.npy", tokens)
    a = perplexity(model, tmp_path / "t.npy", progress=False)
    b = perplexity(model, tokens, seq_len=64, progress=False)
    assert a.seq_len == 64 and a.num_windows == 2
    assert a.loss == pytest.approx(b.loss, rel=1e-6)


@pytest.mark.parametrize("n,seq_len", [(17, 16), (100, 16), (161, 16), (33, 8)])
def test_token_counting(n, seq_len):
    res = perplexity(tiny_model(), stream(n), seq_len=seq_len, progress=False)
    assert res.num_windows == (n - 1) // seq_len
    assert res.tokens_scored == res.num_windows * seq_len


def test_max_tokens_caps_windows():
    res = perplexity(tiny_model(), stream(200), seq_len=16, max_tokens=40, progress=False)
    assert res.num_windows == 2 and res.tokens_scored == 32


def test_too_short_stream_raises():
    with pytest.raises(ValueError, match=r"10 tokens.*seq_len \+ 1 = 17"):
        perplexity(tiny_model(), stream(10), seq_len=16, progress=False)
    with pytest.raises(ValueError, match="vocab_size"):
        perplexity(tiny_model(), np.full(40, V, dtype=np.int64), seq_len=16, progress=False)


class CharTokenizer:
    """A stand-in transformers-style tokenizer: one id per character, EOS 0."""

    eos_token_id = 0

    def encode(self, text, add_special_tokens=False):
        return [1 + (ord(c) % (V - 1)) for c in text]


def test_text_to_tokens_documents_and_whole_file(tmp_path):
    tok = CharTokenizer()
    corpus = tmp_path / "split.txt"
    corpus.write_text(f"ab\ncd\n{DOC_SEPARATOR}\nef\n", encoding="utf-8")
    ids = text_to_tokens(corpus, tok)
    assert ids.tolist() == tok.encode("ab\ncd") + [0] + tok.encode("ef") + [0]
    plain = tmp_path / "plain.txt"
    plain.write_text("hello\nworld\n", encoding="utf-8")
    assert text_to_tokens(plain, tok).tolist() == tok.encode("hello\nworld\n")


# ------------------------------------------------------------------------------------ KV memory


@pytest.mark.parametrize("kv_heads", [4, 2, 1])  # MHA, GQA, MQA
@pytest.mark.parametrize("dtype,itemsize", [(torch.float32, 4), (torch.bfloat16, 2)])
def test_kv_memory_formula_matches_allocation(kv_heads, dtype, itemsize):
    model = Transformer(tiny_config(num_kv_heads=kv_heads))
    mem = kv_memory(model, dtype=dtype, max_len=128)
    assert isinstance(mem, KVMemory)
    expected = 2 * 2 * kv_heads * 8 * itemsize  # layers * (K + V) * kv heads * head_dim * bytes
    assert mem.bytes_per_token_formula == expected
    assert mem.bytes_per_token_measured == expected
    assert mem.agree
    assert mem.per_context == {c: expected * c for c in (1024, 4096, 8192, 32768)}
    assert mem.dtype == str(dtype).removeprefix("torch.")


def test_kv_memory_slot_sharing_halves_bytes():
    full = kv_memory(Transformer(tiny_config(num_layers=4)), dtype=torch.bfloat16, max_len=64)
    shared = kv_memory(Transformer(tiny_config(num_layers=4, kv_slots=(0, 0, 2, 2))), max_len=64)
    assert shared.agree and full.agree
    assert shared.bytes_per_token_formula * 2 == full.bytes_per_token_formula
    assert shared.bytes_per_token_measured * 2 == full.bytes_per_token_measured
    d = shared.to_dict()
    assert d["per_context"]["4096"] == shared.bytes_per_token_formula * 4096
    assert json.loads(json.dumps(d)) == d


# ------------------------------------------------------------------------------------ speed


def test_decode_speed_points_and_cache_length(monkeypatch):
    import kvgraft.eval.speed as speed
    from kvgraft.runtime.engine import Engine

    model = tiny_model()
    engines = []

    class Recording(Engine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            engines.append(self)

    monkeypatch.setattr(speed, "Engine", Recording)
    contexts, batches, new = (8, 20), (1, 3), 6
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # all contexts fit: no warning
        points = decode_speed(model, contexts=contexts, batch_sizes=batches, new_tokens=new, warmup=2, repeats=2)
    assert [(p.context, p.batch_size) for p in points] == [(c, b) for c in contexts for b in batches]
    for p in points:
        assert isinstance(p, SpeedPoint)
        assert p.tokens_per_s > 0 and p.ms_per_token_median > 0 and p.prefill_s > 0
        assert not p.beyond_max_positions
    assert len(engines) == len(points) * 2
    for engine, (c, b) in zip(engines, [(c, b) for c in contexts for b in batches for _ in range(2)]):
        assert engine.cache.max_seqs == b and engine.cache.max_seq_len == c + new + 1
        assert engine.stats["steps"] == 1 + new and engine.stats["tokens"] == b * (c + new)


def test_decode_speed_warns_once_past_max_positions():
    model = tiny_model()
    with pytest.warns(UserWarning, match="max_position_embeddings") as record:
        points = decode_speed(model, contexts=(60, 70), batch_sizes=(1,), new_tokens=5, warmup=1, repeats=1)
    assert len([w for w in record if "max_position_embeddings" in str(w.message)]) == 1
    assert [p.beyond_max_positions for p in points] == [True, True]


def test_decode_speed_other_dtype_leaves_model_alone():
    model = tiny_model()
    points = decode_speed(model, contexts=(8,), batch_sizes=(2,), new_tokens=3, warmup=0, repeats=1, dtype=torch.bfloat16)
    assert len(points) == 1 and model.lm_head.weight.dtype == torch.float32


# ------------------------------------------------------------------------------------ reports


def _eval(model, tokens, tmp_path=None, name=None):
    return evaluate(
        model=model,
        tokens=tokens,
        json_out=None if tmp_path is None else tmp_path / "out" / "report.json",
        name=name,
        options=EvalOptions(seq_len=16, contexts=(8, 16), batch_sizes=(1, 2), new_tokens=4, progress=False),
    )


def test_evaluate_report_json_and_tables(tmp_path):
    model, tokens = tiny_model(), stream(100)
    res = _eval(model, tokens, tmp_path, name="base")
    assert set(res) >= {"model", "params", "config", "perplexity", "kv_memory", "speed"}
    assert res["model"] == "base"
    assert res["params"] == sum(p.numel() for p in model.parameters()) == num_parameters(model.config)
    assert res["config"]["layers"] == 2 and res["config"]["kv_heads"] == 2 and res["config"]["head_dim"] == 8
    assert res["config"]["attention_kinds"] == {"gqa": 2}
    assert res["perplexity"]["ppl"] == pytest.approx(perplexity(model, tokens, seq_len=16, progress=False).ppl, rel=1e-6)
    assert res["kv_memory"]["agree"] is True
    assert len(res["speed"]["points"]) == 4
    assert json.loads((tmp_path / "out" / "report.json").read_text()) == res

    text = format_report(res)
    assert format_ppl(res["perplexity"]["ppl"]) in text
    assert f"{res['kv_memory']['bytes_per_token_formula']:,} B/token" in text
    assert "tokens/s" in text and "ms/token" in text
    speed_lines = [ln for ln in text.splitlines() if ln.strip().startswith(("8 ", "16 "))]
    assert len(speed_lines) == 4 and len({len(ln) for ln in speed_lines}) == 1  # aligned columns

    # a "converted" model with half the KV slots
    conv = tiny_model(num_layers=2, kv_slots=(0, 0))
    res2 = _eval(conv, tokens, name="shared")
    table = compare_table([res, res2])
    lines = table.splitlines()
    assert "base" in lines[0] and "shared" in lines[0] and "shared/base" in lines[0]
    assert format_ppl(res["perplexity"]["ppl"]) in table and format_ppl(res2["perplexity"]["ppl"]) in table
    kv_row = next(ln for ln in lines if ln.startswith("KV B/token formula"))
    assert kv_row.rstrip().endswith("0.500x")
    assert len({len(ln) for ln in lines}) == 1  # aligned


def test_evaluate_uses_model_dir_heldout(tmp_path):
    (tmp_path / "eval").mkdir()
    tokens = stream(50)
    np.save(tmp_path / "eval" / "heldout.npy", tokens)
    model = tiny_model()
    res = evaluate(
        tmp_path, model=model, options=EvalOptions(seq_len=16, contexts=(4,), batch_sizes=(1,), new_tokens=2, progress=False)
    )
    assert res["eval_tokens"].endswith("heldout.npy")
    assert res["perplexity"]["tokens_scored"] == 3 * 16


def test_evaluate_loads_model_and_tokenizer_from_path(tmp_path, monkeypatch):
    # the loaders report what they were asked for (the real ones are tested in test_hf_io.py)
    import kvgraft.eval.report as report

    model, loaded = tiny_model(), []
    monkeypatch.setattr(report, "load_pretrained", lambda path, dtype=None, device="cpu": loaded.append(path) or model)
    monkeypatch.setattr(report, "load_tokenizer_dir", lambda path: CharTokenizer())
    text = tmp_path / "doc.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 3, encoding="utf-8")
    res = evaluate(
        tmp_path, text_file=text, options=EvalOptions(seq_len=16, contexts=(4,), batch_sizes=(1,), new_tokens=2, progress=False)
    )
    ids = text_to_tokens(text, CharTokenizer())
    assert loaded == [tmp_path] and res["model"] == str(tmp_path)
    assert res["perplexity"]["loss"] == pytest.approx(perplexity(model, ids, seq_len=16, progress=False).loss)


def test_evaluate_without_tokens_raises(tmp_path):
    with pytest.raises(ValueError, match="tokens="):
        evaluate(model=tiny_model(), options=EvalOptions(progress=False))
    with pytest.raises(ValueError, match="heldout.npy"):
        evaluate(tmp_path, model=tiny_model(), options=EvalOptions(progress=False))
    with pytest.raises(ValueError, match="model_path"):
        evaluate(options=EvalOptions(progress=False))
