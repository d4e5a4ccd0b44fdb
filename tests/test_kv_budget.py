"""The engine's pools sized from a memory budget (kvgraft.runtime.budget): the bytes match, a small budget
admits fewer sequences and preempts with the same tokens, the default fits a real 8K-context model on a
24 GB machine, and every bad budget is refused naming the value."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import torch

from kvgraft.hf import load_pretrained
from kvgraft.model.cache import PagedKVCache
from kvgraft.model.config import ModelConfig
from kvgraft.model.sizes import pool_bytes
from kvgraft.model.transformer import Transformer
from kvgraft.runtime import budget as budget_mod
from kvgraft.runtime.budget import DEFAULT_KV_BUDGET, parse_kv_budget
from kvgraft.runtime.engine import Engine
from kvgraft.runtime.options import EngineOptions
from kvgraft.runtime.sampling import SamplingParams

MODELS = Path(__file__).resolve().parents[1] / "models"
GiB = 1 << 30
_cache: dict[str, Transformer] = {}


def reference(name: str) -> Transformer:
    if name not in _cache:
        _cache[name] = load_pretrained(MODELS / name).eval()
    return _cache[name]


def smollm2_on_meta() -> Transformer:
    """SmolLM2-135M's shapes (30 layers, 3 KV heads of 64, 8,192 positions), float32, on the meta device: the
    engine sizes and allocates its pools there without taking memory."""
    cfg = ModelConfig(
        vocab_size=49152,
        hidden_size=576,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        intermediate_size=1536,
        head_dim=64,
        max_position_embeddings=8192,
    )
    with torch.device("meta"):
        return Transformer(cfg)


def prompts(lengths: list[int], seed: int, vocab: int = 8192) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("name", ["kvgraft-llama-8m", "kvgraft-ced-8m"])
@pytest.mark.parametrize("prefix_cache", [False, True])
def test_pool_bytes_are_what_the_cache_allocates(name, prefix_cache):
    model = reference(name)
    engine = Engine(model, EngineOptions(max_seqs=4, max_seq_len=300, prefix_cache=prefix_cache, kv_budget=4_000_000))
    per_block, fixed = pool_bytes(
        model.config,
        engine.cache.block_size,
        4,
        300,
        torch.float32,
        engine.cache.ring_groups[0].num_blocks if engine.cache.ring_groups else None,
    )
    assert engine.cache.nbytes == fixed + engine.cache.num_blocks * per_block == engine.pool.nbytes
    assert engine.pool.nbytes <= 4_000_000
    # as many blocks as the budget holds, or all that 4 full-length sequences need (the encoder-decoder)
    assert engine.cache.num_blocks == min((4_000_000 - fixed) // per_block, engine.pool.worst_case_blocks)
    plain = PagedKVCache(model.config, 7, engine.cache.block_size, 3, 200)
    assert plain.nbytes == sum(
        x * y for x, y in zip((1, 7), pool_bytes(model.config, plain.block_size, 3, 200, torch.float32)[::-1])
    )


def test_a_small_budget_admits_fewer_sequences_and_preempts_with_the_same_tokens():
    model = reference("kvgraft-llama-8m")
    ps = prompts([40, 70, 33, 90, 64, 17, 120, 8], seed=2)
    params = [
        SamplingParams(max_new_tokens=n, temperature=0.8 if i % 2 else 0.0, seed=i)
        for i, n in enumerate([30, 24, 40, 20, 36, 44, 16, 40])
    ]

    def run(engine: Engine) -> tuple[list[list[int]], int]:
        ids = [engine.add_request(p, s) for p, s in zip(ps, params)]
        peak = 0
        while engine.has_unfinished():
            engine.step()
            peak = max(peak, len(engine.running))
        return [engine.pop_finished(i).output for i in ids], peak

    free = Engine(model, EngineOptions(max_seqs=8, max_seq_len=256, max_batch_tokens=128))
    expected, peak_free = run(free)
    assert peak_free == 8 and free.stats["preemptions"] == 0
    per_block, fixed = pool_bytes(model.config, 16, 8, 256, torch.float32)
    budget = fixed + 24 * per_block  # 24 blocks: 384 tokens, one request of 256 and a half
    small = Engine(model, EngineOptions(max_seqs=8, max_seq_len=256, max_batch_tokens=128, kv_budget=budget))
    assert small.cache.num_blocks == 24 and small.cache.nbytes == budget
    assert small.pool.concurrency == 1.5 and small.pool.max_concurrency == 1
    got, peak_small = run(small)
    assert got == expected
    assert peak_small < peak_free
    assert small.stats["preemptions"] > 0
    assert small.stats["peak_used_bytes"] <= budget


def test_the_default_fits_an_8k_model_on_a_24_gb_machine(monkeypatch, caplog):
    model = smollm2_on_meta()
    monkeypatch.setattr(budget_mod, "available_memory", lambda device: 20 * GiB)
    with caplog.at_level(logging.INFO, logger="kvgraft.runtime.engine"):
        engine = Engine(model)  # max_seqs 32, max_seq_len 8,192, float32
    pool = engine.pool
    worst = 32 * 8192 * 46080  # the old default: 32 full-length sequences, 12.4 GB
    assert pool.worst_case_blocks * pool.block_bytes == worst
    assert pool.budget_bytes == DEFAULT_KV_BUDGET and engine.cache.nbytes <= DEFAULT_KV_BUDGET
    assert pool.num_blocks == DEFAULT_KV_BUDGET // (16 * 46080)
    assert 11 < pool.concurrency < 12 and pool.max_concurrency == 11
    assert 2 * engine.cache.nbytes + 2 * 135e6 * 4 < 12e9  # two engines and their weights: half a 24 GB machine
    assert "4.00 GiB" in caplog.text and "11.38x" in caplog.text and "max_seqs 32" in caplog.text
    # a machine with less than 8 GiB available gets half of it
    monkeypatch.setattr(budget_mod, "available_memory", lambda device: 6 * GiB)
    assert Engine(model).pool.budget_bytes == 3 * GiB
    # a fraction of what is available, and a small model never gets more than its worst case
    assert Engine(model, EngineOptions(kv_budget=0.25)).pool.budget_bytes == 6 * GiB // 4
    assert Engine(model, EngineOptions(kv_budget="25%")).pool.budget_bytes == 6 * GiB // 4
    small = Engine(reference("kvgraft-llama-8m"), EngineOptions(max_seqs=4))
    assert small.cache.num_blocks == small.pool.worst_case_blocks == 4 * math.ceil(512 / 16)


@pytest.mark.parametrize(
    "bad, match",
    [
        (0, r"kv_budget \(0\) must be a positive number of bytes"),
        (-5, r"kv_budget \(-5\)"),
        (1.5, r"kv_budget \(1.5\) as a float is a fraction"),
        (0.0, r"kv_budget \(0.0\)"),
        (float("nan"), r"kv_budget \(nan\)"),
        (True, r"kv_budget \(True\)"),
        ([1], r"kv_budget \(\[1\]\)"),
        ("lots", r"kv_budget \('lots'\)"),
        ("4 parsecs", r"unknown unit 'parsecs'"),
        ("0%", r"kv_budget \('0%'\) must be a percentage"),
        ("120%", r"kv_budget \('120%'\)"),
        ("2.5", r"kv_budget \('2.5'\) must be a whole number of bytes"),
    ],
)
def test_bad_budgets_are_refused_naming_the_value(bad, match):
    with pytest.raises(ValueError, match=match):
        Engine(reference("kvgraft-llama-8m"), EngineOptions(max_seqs=2, kv_budget=bad))


def test_budgets_that_cannot_hold_a_request_and_conflicting_arguments_are_refused():
    model = reference("kvgraft-llama-8m")
    with pytest.raises(ValueError, match=r"kv_budget 1.0 MiB .* one request of max_seq_len 512 tokens needs 32 blocks"):
        Engine(model, EngineOptions(max_seqs=2, kv_budget="1MiB"))
    Engine(model, EngineOptions(max_seqs=2, max_seq_len=64, kv_budget="1MiB"))  # shorter requests fit
    with pytest.raises(ValueError, match=r"give num_blocks \(10\) or kv_budget \('1GiB'\), not both"):
        Engine(model, EngineOptions(num_blocks=10, kv_budget="1GiB"))
    for name, kwargs in [
        ("num_blocks", {"num_blocks": 0}),
        ("num_blocks", {"num_blocks": 2.0}),
        ("dtype", {"dtype": "fp16"}),
        ("prefix_cache", {"prefix_cache": "yes"}),
    ]:
        with pytest.raises(ValueError, match=rf"{name} \("):
            Engine(model, EngineOptions(**kwargs))
    with pytest.raises(ValueError, match=r"detokenize \("):
        Engine(model, detokenize="not a function")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"options \(\{'max_seqs': 2\}\) must be an EngineOptions"):
        Engine(model, {"max_seqs": 2})  # type: ignore[arg-type]


def test_parse_kv_budget():
    assert parse_kv_budget("4GiB") == 4 * GiB
    assert parse_kv_budget("512 MiB") == 512 << 20
    assert parse_kv_budget("2.5GB") == 2_500_000_000
    assert parse_kv_budget("1e9") == 10**9
    assert parse_kv_budget("123456") == 123456
    assert parse_kv_budget("0.3") == 0.3
    assert parse_kv_budget("30%") == 0.3
    assert parse_kv_budget("1") == 1.0  # a plain number up to 1 is a fraction


def test_serve_prints_the_budget_and_concurrency(monkeypatch, capsys):
    from kvgraft.cli import main

    started = {}
    monkeypatch.setattr("kvgraft.cli.cmd.serve.run_server", lambda server, host, port, log_level: started.update(s=server))
    argv = ["serve", "kvgraft-llama-8m", "--kv-budget", "8MiB", "--max-seq-len", "256", "--no-shipped-adapters"]
    assert main([*argv, "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "KV cache budget 8.0 MiB (given)" in out and "maximum concurrency for 256-token requests" in out
    engine = started["s"].engine
    assert engine.pool.budget_bytes == 8 << 20 and engine.cache.dtype == torch.bfloat16  # twice the blocks of fp32
    assert (
        engine.cache.nbytes <= 8 << 20
        and engine.pool.block_bytes == pool_bytes(engine.model.config, 16, 32, 256, torch.bfloat16)[0]
    )
    assert main(["serve", "kvgraft-llama-8m", "--kv-budget", "8 parsecs"]) != 0
    assert "kv_budget ('8 parsecs')" in capsys.readouterr().err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_pools_are_zeros_from_lazily_mapped_memory(dtype):
    from kvgraft.model.blocks import lazy_zeros

    t = lazy_zeros((3, 5, 7), dtype, "cpu")
    assert t.dtype == dtype and t.shape == (3, 5, 7) and t.is_contiguous() and not t.any()
    t[1, 2] = 1.5
    assert float(t.sum()) == 7 * 1.5
    cache = PagedKVCache(reference("kvgraft-llama-8m").config, 4, 16, 2, 64, dtype)
    assert all(p.dtype == dtype and not p.any() for p in cache.paged.values())
    assert lazy_zeros((0, 4), dtype, "cpu").shape == (0, 4)


def test_available_memory_honours_a_cgroup_limit(monkeypatch, tmp_path):
    (tmp_path / "memory.max").write_text(f"{3 << 30}\n")
    (tmp_path / "memory.current").write_text(f"{1 << 30}\n")
    real_path = budget_mod.Path
    monkeypatch.setattr(budget_mod, "Path", lambda p: tmp_path if p == "/sys/fs/cgroup" else real_path(p))
    monkeypatch.setattr(budget_mod, "_host_available", lambda: 20 * GiB)
    assert budget_mod.available_memory("cpu") == 2 * GiB  # the limit less what the cgroup uses
    (tmp_path / "memory.max").write_text("max\n")
    assert budget_mod.available_memory("cpu") == 20 * GiB
    with pytest.raises(ValueError, match="cannot measure the memory available on device mps"):
        budget_mod.available_memory("mps")


@pytest.mark.parametrize("name", ["kvgraft-llama-8m", "kvgraft-ced-8m"])
def test_the_prefix_cache_under_a_small_budget_keeps_the_tokens(name):
    """kvgraft serve's engine (prefix cache on) with budgets below its worst case: at 20 blocks requests are
    preempted (kept prompts go first), at 44 kept prompts are hit; every request gives its tokens alone."""
    model = reference(name)
    g = torch.Generator().manual_seed(7)
    system = torch.randint(0, 8192, (40,), generator=g).tolist()
    prompts = [system + torch.randint(0, 8192, (n,), generator=g).tolist() for n in (5, 30, 12, 60, 3, 25)]
    prompts += [prompts[1], prompts[3][:50]]  # a prompt again, and one that extends a kept part
    params = [SamplingParams(max_new_tokens=n) for n in (10, 4, 16, 8, 12, 6, 9, 7)]
    alone = [Engine(model, EngineOptions(max_seqs=1, max_seq_len=128)).generate([p], [s])[0] for p, s in zip(prompts, params)]
    probe = Engine(model, EngineOptions(max_seqs=6, max_seq_len=128, prefix_cache=True, num_blocks=8))
    seen = {}
    for blocks in (20, 44):  # the worst case: 6 x (8 + 2) = 60 blocks
        budget = probe.pool.fixed_bytes + blocks * probe.pool.block_bytes
        engine = Engine(model, EngineOptions(max_seqs=6, max_seq_len=128, prefix_cache=True, kv_budget=budget))
        assert engine.cache.num_blocks == blocks < engine.pool.worst_case_blocks
        ids = [engine.add_request(p, s) for p, s in zip(prompts, params)]
        engine.run()
        assert [engine.pop_finished(i).output for i in ids] == alone
        seen[blocks] = engine.stats["preemptions"], engine.prefix_stats["hits"]
    assert seen[20][0] > 0 and seen[44][1] > 0, seen
