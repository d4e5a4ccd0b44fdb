"""The engine on the real model (SmolLM2-135M-Instruct, 8,192 positions) under a memory budget: the default
fits a 24 GB machine, and a budget that holds fewer requests than are running preempts and gives every
request the tokens it gives alone. Marked `real` (`make test-real`); skipped when the model is not fetched."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvgraft.reference import fetch_command, fetched_model_dir

NAME = "smollm2-135m-instruct"
pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def model():
    path: Path | None = fetched_model_dir(NAME)
    if path is None:
        pytest.skip(f"{NAME} is not fetched: run `make real-model` ({fetch_command(NAME)})")
    from kvgraft.hf import load_pretrained

    return load_pretrained(path, dtype=torch.float32).eval()


def test_the_default_pool_fits_and_a_small_budget_preempts_with_the_same_tokens(model):
    from kvgraft.model.sizes import pool_bytes
    from kvgraft.runtime.engine import Engine
    from kvgraft.runtime.options import EngineOptions
    from kvgraft.runtime.sampling import SamplingParams

    with torch.device("meta"):  # the default pool's size, without allocating 4 GiB here
        meta = type(model)(model.config)
    pool = Engine(meta).pool  # max_seqs 32, max_seq_len 8,192, float32
    assert pool.nbytes <= 4 << 30 < pool.worst_case_blocks * pool.block_bytes  # 4 GiB, not 12.4 GB
    assert 11 < pool.concurrency < 12
    g = torch.Generator().manual_seed(0)
    lengths = [40, 120, 7, 90, 60, 150]
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in lengths]
    params = SamplingParams(max_new_tokens=12)
    alone = [Engine(model, EngineOptions(max_seqs=1, max_seq_len=256)).generate([p], params)[0] for p in prompts]
    per_block, fixed = pool_bytes(model.config, 16, 6, 256, torch.float32)
    engine = Engine(model, EngineOptions(max_seqs=6, max_seq_len=256, kv_budget=fixed + 24 * per_block))  # 384 tokens in all
    assert engine.pool.max_concurrency == 1 and engine.cache.nbytes == fixed + 24 * per_block
    assert engine.generate(prompts, params) == alone
    assert engine.stats["preemptions"] > 0
