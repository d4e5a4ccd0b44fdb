"""``EngineOptions``: one typed object for the engine's sizes, budget and features, checked on construction."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import pytest
import torch

from kvgraft.hf import load_pretrained
from kvgraft.model.transformer import Transformer
from kvgraft.runtime import Engine, EngineOptions, SamplingParams

MODELS = Path(__file__).resolve().parents[1] / "models"


@functools.cache
def reference(name: str) -> Transformer:
    return load_pretrained(MODELS / name).eval()


def test_dtype_by_name_becomes_the_torch_dtype_and_the_cache_uses_it():
    assert EngineOptions(dtype="bfloat16").dtype is torch.bfloat16
    assert EngineOptions(dtype=torch.float16).dtype is torch.float16
    engine = Engine(reference("kvgraft-llama-8m"), EngineOptions(max_seqs=1, max_seq_len=64, dtype="bfloat16"))
    assert engine.cache.dtype is torch.bfloat16


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_seqs": 0}, r"max_seqs \(0\)"),
        ({"max_batch_tokens": True}, r"max_batch_tokens \(True\)"),
        ({"block_size": 2.5}, r"block_size \(2.5\)"),
        ({"prefix_entries": -1}, r"prefix_entries \(-1\)"),
        ({"prefix_cache": 0}, r"prefix_cache \(0\) must be True, False or None"),
        ({"packed_linears": 1}, r"packed_linears \(1\)"),
        ({"dtype": "int8"}, r"dtype \('int8'\) must be a torch.dtype, one of \['bfloat16', 'float16', 'float32'\]"),
        ({"kv_budget": -5}, r"kv_budget \(-5\)"),
    ],
)
def test_bad_options_are_refused_before_any_work_naming_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineOptions(**kwargs)


def test_options_are_frozen_and_the_engine_keeps_them():
    options = EngineOptions(max_seqs=2, max_seq_len=64)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.max_seqs = 3  # type: ignore[misc]
    engine = Engine(reference("kvgraft-llama-8m"), options)
    assert engine.options is options and engine.cache.max_seqs == 2 and engine.prefix is None  # prefix cache: off
    on = Engine(reference("kvgraft-llama-8m"), dataclasses.replace(options, prefix_cache=True))
    assert on.prefix is not None
    out = on.generate([[1, 2, 3, 4]], SamplingParams(max_new_tokens=3))
    assert out == engine.generate([[1, 2, 3, 4]], SamplingParams(max_new_tokens=3))


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_prefault_writes_the_pools_pages_at_construction_and_changes_no_token():
    model = reference("kvgraft-llama-8m")
    options = EngineOptions(max_seqs=4, max_seq_len=256, num_blocks=2048)  # 32K tokens' pools: tens of MB
    lazy = Engine(model, options)
    before = _rss_bytes()
    hot = Engine(model, dataclasses.replace(options, prefault=True))
    grown = _rss_bytes() - before
    assert grown >= 0.9 * hot.cache.nbytes, (grown, hot.cache.nbytes)  # resident now, not on first write
    assert all(not t.any() for t in hot.cache.paged.values())  # zeros still
    params = SamplingParams(max_new_tokens=6)
    prompts = [[1, 2, 3, 4, 5], list(range(7, 60))]
    assert hot.generate(prompts, params) == lazy.generate(prompts, params)
    with pytest.raises(ValueError, match=r"prefault \(1\) must be True or False"):
        EngineOptions(prefault=1)  # type: ignore[arg-type]
