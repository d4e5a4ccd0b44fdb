"""The paged cache and the continuous-batching engine: batching is exact, forks share blocks, preemption
recomputes, sampling is per request. On the reference architectures with real trained weights (the
shipped Llama and causal encoder-decoder; an MLA model with the Llama's trained embeddings and MLPs)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvgraft.hf import load_pretrained
from kvgraft.model.batch import BatchContext
from kvgraft.model.blocks import CacheFullError
from kvgraft.model.cache import PagedKVCache
from kvgraft.model.transformer import Transformer
from kvgraft.runtime.engine import Engine
from kvgraft.runtime.options import EngineOptions
from kvgraft.runtime.sampling import SamplingParams

MODELS = Path(__file__).resolve().parents[1] / "models"
_cache: dict[str, Transformer] = {}


def reference(kind: str) -> Transformer:
    if kind not in _cache:
        if kind == "llama":
            model = load_pretrained(MODELS / "kvgraft-llama-8m")
        elif kind == "ced":
            model = load_pretrained(MODELS / "kvgraft-ced-8m")
        else:  # MLA on every layer (d_c 24: the folded decode path), the Llama's trained non-attention weights
            llama = reference("llama")
            cfg = llama.config.replace(
                attention_kinds=("mla",) * llama.config.num_layers,
                kv_lora_rank=24,
                qk_rope_head_dim=16,
                qk_nope_head_dim=32,
                v_head_dim=32,
            )
            torch.manual_seed(0)
            model = Transformer(cfg)
            model.init_weights(0)
            state = {k: v for k, v in llama.state_dict().items() if ".self_attn." not in k}
            model.load_state_dict(state, strict=False)
        _cache[kind] = model.eval()
    return _cache[kind]


def prompts(n: int, lengths: list[int], seed: int = 0, vocab: int = 8192) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for length in lengths[:n]]


# prompt lengths from 1 to 450: block boundaries of 16 and, for the encoder-decoder, its window of 64
LENGTHS = [1, 3, 15, 16, 17, 31, 64, 65, 100, 129, 200, 257, 300, 333, 401, 450]
MAX_NEW = [5, 12, 3, 20, 8, 1, 16, 9, 24, 7, 11, 4, 18, 2, 13, 6]


def alone(model, prompt, params) -> list[int]:
    return Engine(model, EngineOptions(max_seqs=1, max_batch_tokens=512)).generate([prompt], params)[0]


@pytest.mark.parametrize("kind", ["llama", "mla", "ced"])
def test_continuous_batching_equals_each_request_alone(kind):
    model = reference(kind)
    ps = prompts(16, LENGTHS, seed=1)
    params = [SamplingParams(max_new_tokens=n) for n in MAX_NEW]
    expected = [alone(model, p, s) for p, s in zip(ps, params)]
    # a small token budget: prompts are prefilled in chunks, in the same steps as other rows' decodes
    engine = Engine(model, EngineOptions(max_seqs=16, max_batch_tokens=96))
    ids = {}
    order = list(range(16))
    for i in order[:6]:  # some now, the rest admitted while those run
        ids[i] = engine.add_request(ps[i], params[i])
    phases = []  # per step: the new-token counts of its rows
    schedule = engine.schedule
    engine.schedule = lambda: (lambda rows: (phases.append(sorted(n for _, n in rows)), rows)[1])(schedule())
    steps = 0
    while engine.has_unfinished() or len(ids) < 16:
        if steps % 3 == 2 and len(ids) < 16:
            i = order[len(ids)]
            ids[i] = engine.add_request(ps[i], params[i])
        engine.step()
        steps += 1
    got = [engine.requests[ids[i]].output for i in range(16)]
    assert got == expected
    assert any(len(p) > 1 and p[0] == 1 and p[-1] > 1 for p in phases)  # decodes and a prefill chunk together
    assert engine.stats["steps"] < sum(len(p) for p in ps) / 8  # batched: far fewer steps than tokens


@pytest.mark.parametrize("kind", ["llama", "ced"])
def test_forked_sequences_share_blocks_and_diverge(kind):
    model = reference(kind)
    cfg = model.config
    cache = PagedKVCache(cfg, num_blocks=32, block_size=16, max_seqs=4, max_seq_len=256)
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(0, cfg.vocab_size, (90,), generator=g)  # 5 full blocks + 10 tokens
    tails = [torch.randint(0, cfg.vocab_size, (30,), generator=g) for _ in range(2)]
    with torch.inference_mode():
        a = cache.add_sequence()
        model(prefix, ctx=BatchContext(cache, [a], [90]))
        used = cache.free_blocks
        b = cache.fork(a)
        assert cache.free_blocks == used  # no copy at the fork
        assert cache.block_table(a) == cache.block_table(b)
        assert all(cache.refcount(blk) == 2 for blk in cache.block_table(a))
        # both continue in one step: the shared partial block is copied once, the full ones stay shared
        out = model(torch.cat(tails), ctx=BatchContext(cache, [a, b], [30, 30]))[0]
        ta, tb = cache.block_table(a), cache.block_table(b)
        assert ta[:5] == tb[:5] and ta[5] != tb[5]
        assert all(cache.refcount(blk) == 2 for blk in ta[:5])
        for i, tail in enumerate(tails):
            full = model(torch.cat([prefix, tail])[None])[0, 90:]
            torch.testing.assert_close(out[30 * i : 30 * (i + 1)], full, atol=2e-4, rtol=0)
        cache.free(a)
        assert all(cache.refcount(blk) == 1 for blk in tb[:5])
        cache.free(b)
        assert cache.free_blocks == 32 and cache.used_bytes == 0


@pytest.mark.parametrize("kind", ["llama", "ced"])
def test_preemption_under_a_tiny_pool_finishes_with_the_same_tokens(kind):
    model = reference(kind)
    ps = prompts(6, [40, 70, 33, 90, 64, 17], seed=2)
    params = [SamplingParams(max_new_tokens=n, temperature=0.8, seed=i) for i, n in enumerate([14, 9, 18, 6, 12, 16])]
    expected = [alone(model, p, s) for p, s in zip(ps, params)]
    engine = Engine(model, EngineOptions(num_blocks=10, block_size=16, max_seqs=6, max_batch_tokens=64))  # 160 tokens in all
    got = engine.generate(ps, params)
    assert engine.stats["preemptions"] > 0
    assert got == expected


def test_paged_cache_bytes_are_within_a_block_of_what_is_needed():
    cfg = reference("llama").config
    cache = PagedKVCache(cfg, num_blocks=64, block_size=16, max_seqs=8, max_seq_len=512)
    seqs = [cache.add_sequence() for _ in range(3)]
    for s, n in zip(seqs, (1, 16, 100)):
        cache.extend(s, n)
        cache.commit(s, n)
    per_token = cfg.kv_cache_bytes(1, 4)
    assert cache.needed_bytes() == (1 + 16 + 100) * per_token
    assert cache.used_bytes == (1 + 1 + 7) * 16 * per_token  # whole blocks
    assert cache.free_bytes == cache.nbytes - cache.used_bytes
    small = PagedKVCache(cfg, num_blocks=4, block_size=16, max_seqs=1, max_seq_len=512)
    with pytest.raises(CacheFullError, match="needs 7 more blocks for 100 tokens, 4 free of 4"):
        small.extend(small.add_sequence(), 100)
    with pytest.raises(CacheFullError, match="all 1 sequence slots"):
        small.add_sequence()


def test_sampling_is_per_request_and_stops():
    model = reference("llama")
    p = prompts(3, [20, 50, 8], seed=4)
    hot = SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.9, seed=7)
    a = Engine(model).generate([p[0]], hot)[0]
    b = Engine(model, EngineOptions(max_batch_tokens=32)).generate(p, [hot, SamplingParams(max_new_tokens=5), hot])
    assert b[0] == a and b[2] != a  # same seed, same tokens whatever the batch; another prompt differs
    greedy = alone(model, p[1], SamplingParams(max_new_tokens=12))
    stop = greedy[4]
    first = greedy.index(stop)
    got = alone(model, p[1], SamplingParams(max_new_tokens=12, stop_token_ids=(stop,)))
    assert got == greedy[: first + 1]
    text = Engine(model, detokenize=lambda ids: " ".join(map(str, ids)))
    out = text.generate([p[1]], SamplingParams(max_new_tokens=12, stop=(f" {greedy[2]} ",)))[0]
    assert len(out) <= 4 and text.stats["steps"] >= 1


def test_cancel_frees_the_request_and_bad_requests_are_refused():
    model = reference("llama")
    engine = Engine(model, EngineOptions(max_seqs=2, max_seq_len=128))
    rid = engine.add_request(list(range(40)), SamplingParams(max_new_tokens=50))
    engine.step()
    assert engine.cache.used_bytes > 0
    engine.cancel(rid)
    assert engine.requests[rid].finish_reason == "cancelled" and engine.cache.used_bytes == 0
    assert not engine.has_unfinished()
    with pytest.raises(ValueError, match="exceeds the engine's max_seq_len"):
        engine.add_request(list(range(100)), SamplingParams(max_new_tokens=50))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request([8192])
    with pytest.raises(ValueError, match="at least one token"):
        engine.add_request([])
    with pytest.raises(ValueError, match="stop strings need a detokenize"):
        engine.add_request([1], SamplingParams(stop=("x",)))
    for bad, msg in [
        (dict(max_new_tokens=-1), "max_new_tokens"),
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(seed=1.5), "seed"),
        (dict(stop=("",)), "stop"),
    ]:
        with pytest.raises(ValueError, match=msg):
            SamplingParams(**bad)


def test_every_engine_caller_fits_blocks_to_the_compression_rate():
    """An encoder-decoder whose compression rate does not divide 16 (m = 3): generate, the engine and the
    decode benchmark choose whole-entry blocks (18 tokens) instead of failing; cached decode == full forward."""
    from kvgraft.eval.speed import decode_speed
    from kvgraft.model.presets import get_preset
    from kvgraft.runtime import generate

    torch.manual_seed(0)
    model = Transformer(get_preset("ced-tiny").replace(compress_rate=3, sliding_window=8))
    model.init_weights(0)
    model.eval()
    assert Engine(model).cache.block_size == 18
    prompt = torch.randint(0, 512, (2, 20), generator=torch.Generator().manual_seed(1))
    out = generate(model, prompt, 6)
    with torch.no_grad():
        seq = prompt
        for _ in range(6):
            seq = torch.cat([seq, model(seq)[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(out, seq)
    assert len(decode_speed(model, contexts=(20,), batch_sizes=(2,), new_tokens=3, warmup=1, repeats=1)) == 1


def test_sampling_at_float32_underflow_limits():
    """A temperature or top_p that rounds to 0 in fp32 used to fail the whole engine step (softmax of
    logits / 1e-40 is NaN; top_p 1e-46 dropped every token): tiny temperatures act as greedy, the most
    likely token always stays in the nucleus."""
    from kvgraft.runtime.sampling import sample_next

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1)
    assert torch.equal(sample_next(logits, 1e-40, 1.0, gen), logits.argmax(-1))
    assert torch.equal(sample_next(logits, 0.7, 1e-46, gen), logits.argmax(-1))
