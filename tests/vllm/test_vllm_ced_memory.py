"""Memory as designed: what vLLM allocates for kvgraft's causal encoder-decoder (``kvgraft.vllm``), next to
kvgraft's own formula (``ModelConfig.kv_cache_bytes``, ``kvgraft.eval.memory``) and the stock Llama reference.

- the cache groups vLLM built hold exactly: a window per layer, a stream and a pending cache per kv_source
  layer, and nothing for the layers that only read the stream; every row is ``cache_layout``'s width;
- one request's blocks at a context: the windows hold a bounded number of blocks (vLLM frees what leaves
  the window), the stream one block per ``stream_block`` tokens, the pending cache one block;
- bytes per token: vLLM's within the stated slack of kvgraft's formula (block granularity of the windows,
  the stream's last block, one padding window layer and padded pages), falling with context like kvgraft's;
  the Llama reference's equal to its formula exactly.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from engines import VllmRunner, load_kvgraft

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
CED = ROOT / "models" / "kvgraft-ced-8m"
LLAMA = ROOT / "models" / "kvgraft-llama-8m"
CONTEXTS = (64, 128, 256, 480)


def _prompt(model_dir: Path, n: int) -> list[int]:
    return np.load(model_dir / "eval" / "heldout.npy")[:n].astype(np.int64).tolist()


@pytest.fixture(scope="module")
def ced_runner():
    with VllmRunner(CED, max_model_len=512, max_num_batched_tokens=512) as r:
        yield r


def test_ced_cache_groups_are_as_designed(ced_runner):
    from kvgraft.model.config import cache_layout
    from kvgraft.vllm.geometry import page_geometry
    from kvgraft.vllm.memory import cache_groups

    config = load_kvgraft(CED).config
    layout = cache_layout(config)
    geometry = page_geometry(config, 4)
    groups, per_block = cache_groups(ced_runner.llm)
    # not an MLA model to vLLM (the CPU platform would switch chunked prefill and prefix caching off)
    assert ced_runner.llm.llm_engine.vllm_config.model_config.use_mla is False
    owners: dict[str, set[int]] = {"window_cache": set(), "stream_cache": set(), "pending_cache": set()}
    for g in groups:
        kinds = {name.rsplit(".", 1)[1] for name in g.layers}
        assert len(kinds) == 1, f"a group mixes cache kinds: {g.layers}"
        kind = kinds.pop()
        owners[kind] |= {int(name.split(".")[2]) for name in g.layers}
        assert g.page_bytes == geometry.page_bytes, g
    sources = set(config.kv_source_layers)
    assert owners["window_cache"] == set(range(config.num_layers))
    assert owners["stream_cache"] == sources, "only kv_source layers may own a shared stream"
    assert owners["pending_cache"] == sources
    readers = {l for l in range(config.num_layers) if config.kv_source_of(l) not in (None, l)}
    assert readers == {2, 5, 6, 7} and not readers & (owners["stream_cache"] | owners["pending_cache"])
    # every row is kvgraft's width: the spec of each cache module
    specs = ced_runner.apply_model(lambda m: {k: v.spec for k, v in m.cache_layers.items()})
    for (layer, kind), spec in specs.items():
        width = {
            "window_cache": layout.rings[layer],
            "stream_cache": layout.segments.get(layer),
            "pending_cache": layout.pending.get(layer),
        }[kind]
        assert spec.head_size == width and spec.head_size_v == 0, (layer, kind, spec)
    assert per_block == geometry.page_bytes * max(len(g.layers) for g in groups)


def test_ced_bytes_per_token_next_to_kvgraft_formula(ced_runner):
    from kvgraft.vllm.geometry import page_geometry
    from kvgraft.vllm.memory import request_usage

    config = load_kvgraft(CED).config
    geometry = page_geometry(config, 4)
    W, B = config.sliding_window, geometry.window_block
    rows = []
    for n in CONTEXTS:
        usage = request_usage(ced_runner.llm, _prompt(CED, n))
        by_kind = {}
        for g, held in zip(usage.groups, usage.held_blocks):
            by_kind.setdefault(g.layers[0].rsplit(".", 1)[1], []).append(held)
        ctx = usage.context
        # windows: the blocks of the last W - 1 tokens and the current one, not the whole context
        assert all(h <= math.ceil(W / B) + 1 for h in by_kind["window_cache"]), by_kind
        assert by_kind["stream_cache"] == [math.ceil(ctx / geometry.stream_block)], by_kind
        assert all(h <= 2 for h in by_kind["pending_cache"]), by_kind
        formula = config.kv_cache_bytes(ctx, 4)
        rows.append((ctx, usage.bytes, formula))
        # slack: each window group rounds W up to whole blocks plus one, the stream to its block, one pending
        # block per group, and every block id spans the largest group's layer count
        assert formula <= usage.bytes <= 1.65 * formula, (ctx, usage.bytes, formula, by_kind)
    print("\ncontext  vLLM B/token  kvgraft formula B/token  ratio")
    for ctx, got, formula in rows:
        print(f"{ctx:7d}  {got / ctx:12.1f}  {formula / ctx:23.1f}  {got / formula:5.2f}")
    per_token = [got / ctx for ctx, got, _ in rows]
    assert per_token == sorted(per_token, reverse=True), "a CED's bytes per token fall with context (fixed windows)"


def test_llama_reference_bytes_per_token_equal_formula():
    from kvgraft.vllm.memory import request_usage

    config = load_kvgraft(LLAMA).config
    with VllmRunner(LLAMA, max_model_len=512, max_num_batched_tokens=512) as runner:
        usage = request_usage(runner.llm, _prompt(LLAMA, 480))
        (group,) = usage.groups
    per_token = group.page_bytes * len(group.layers) / group.block_size
    assert per_token == config.kv_bytes_per_token(4), (per_token, config.kv_bytes_per_token(4))
    assert usage.held_blocks == [math.ceil(usage.context / group.block_size)]
